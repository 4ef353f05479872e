"""Finding an agent: `--agent` parsed once into an `AgentRef`, and loaded
from it where its sessions run; `--agent-func-path` (OpenRLHF's agent file)
checked on the driver.

The reference, not the function, travels to the runners that run the
sessions (agents/runner.py): each loads the function again from it, as a
worker imports anything else. A file's reference carries the file's source,
read on the driver: on another node of a cluster the driver's path is not
there (only the project's packages travel in the job's runtime_env), so the
runners run the source the driver read. Its neighbours (modules it imports
from its folder) do not travel: package them, and give `module:function`.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from agents.contract import AgentFunction


@dataclass(frozen=True)
class AgentRef:
    """Where an agent function lives: `module:function`, or a Python file's
    absolute path and the function."""

    #: A dotted module name, or a Python file's absolute path.
    module: str
    function: str
    #: The driver's working directory when a dotted module's package is
    #: there: searched after `sys.path` wherever the agent loads, as `python
    #: -m` would search it (the `rolloutflow` console script does not put it
    #: on the path, and a Ray worker's own working directory may differ).
    folder: str | None = None
    #: A file's source as the driver read it (None for a module): loaded
    #: from this wherever the agent runs.
    source: str | None = field(default=None, repr=False, compare=False)

    @property
    def is_file(self) -> bool:
        return self.module.endswith(".py")

    def __str__(self) -> str:
        return f"{self.module}:{self.function}"

    @classmethod
    def parse(cls, text: str) -> AgentRef:
        """`text` ("module:function" or "file.py:function") with a file made
        absolute, and a module looked for in the working directory. Only its
        form is checked here; `load` imports it."""
        parts = text.split(":") if isinstance(text, str) else []
        if len(parts) != 2 or not all(parts):
            raise ValueError(
                f"agent must be 'package.module:function' or 'file.py:function', got {text!r}"
            )
        module, function = parts
        if module.endswith(".py"):
            path = Path(module).absolute()
            try:
                source = path.read_text()
            except OSError as exc:
                raise ValueError(f"agent {text}: cannot import {str(path)!r}: {exc}") from exc
            return cls(str(path), function, source=source)
        here = os.getcwd()
        found = importlib.machinery.PathFinder.find_spec(module.partition(".")[0], [here])
        return cls(module, function, here if found is not None else None)

    def load(self) -> AgentFunction:
        """The async function; a clear error when it does not import or is not async."""
        try:
            module = self._from_source() if self.is_file else self._import()
        except (ImportError, OSError) as exc:
            hint = ""
            # The agent's own module was not found (not one it imports): a
            # file in a folder off the path is given by its path.
            if not self.is_file and getattr(exc, "name", None) == self.module.partition(".")[0]:
                hint = (
                    f" (nor in the working directory {os.getcwd()}); a Python file is "
                    f"given as 'path/to/{self.module.replace('.', '/')}.py:{self.function}'"
                )
            raise ValueError(f"agent {self}: cannot import {self.module!r}: {exc}{hint}") from exc
        fn = getattr(module, self.function, None)
        if not callable(fn):
            raise ValueError(f"agent {self}: {self.module} has no callable {self.function!r}")
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(
                f"agent {self} is not async: it must be 'async def {self.function}(client, row)'"
            )
        return fn

    def _from_source(self) -> ModuleType:
        """The file's module, run from the source the driver read (under its
        path: tracebacks name it). In `sys.modules`, as an import puts it:
        dataclasses and pickling look a class's module up there."""
        if self.source is None:
            raise ImportError(f"no source of {self.module}: make the reference with AgentRef.parse")
        name = f"agent_file_{Path(self.module).stem}"
        spec = importlib.util.spec_from_loader(name, loader=None, origin=self.module)
        module = importlib.util.module_from_spec(spec)
        module.__file__ = self.module
        sys.modules[name] = module
        try:
            exec(compile(self.source, self.module, "exec"), module.__dict__)
        except BaseException:
            del sys.modules[name]
            raise
        return module

    def _import(self) -> ModuleType:
        # Last, so that it shadows nothing installed; kept after the import,
        # as under `python -m`: the agent's own imports of its neighbours may
        # run later, inside a call.
        if self.folder is not None and self.folder not in sys.path:
            sys.path.append(self.folder)
        return importlib.import_module(self.module)


def load_agent(text: str) -> AgentFunction:
    """The async function at `text` ("module:function" or "file.py:function");
    a clear error before anything starts when it does not import or is not async."""
    return AgentRef.parse(text).load()


def check_func_path(path: str) -> str:
    """OpenRLHF's agent file, absolute: it must exist and be a .py file."""
    location = Path(path)
    if location.suffix != ".py" or not location.is_file():
        raise ValueError(f"agent_func_path {path!r}: no Python file at {location.absolute()}")
    return str(location.absolute())
