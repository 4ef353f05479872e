"""Finding an agent: `--agent` parsed once into an `AgentRef`, and loaded
from it where its sessions run; `--agent-func-path` (OpenRLHF's agent file)
checked on the driver.

The reference, not the function, travels to the Ray tasks that run the
sessions (agents/runner.py): each loads the function again from it, as a
worker imports anything else.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import os
import sys
from dataclasses import dataclass
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
            return cls(str(Path(module).absolute()), function)
        here = os.getcwd()
        found = importlib.machinery.PathFinder.find_spec(module.partition(".")[0], [here])
        return cls(module, function, here if found is not None else None)

    def load(self) -> AgentFunction:
        """The async function; a clear error when it does not import or is not async."""
        # Here, not at the top: the `training` package imports torch, and
        # everything under `agents` (the router's actor too) imports this module.
        from training.rewards import import_file

        try:
            module = import_file(self.module) if self.is_file else self._import()
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
