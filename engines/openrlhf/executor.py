"""OpenRLHF's agent executor for an `agent_func_path`: loaded in the engine
actor (`load_agent_executor`, for `engines.openrlhf.agents`), and the file
checked on the driver before any engine exists (`check_agent_func_path`, for
the engine-set spec).

Its own module: the engine-set spec needs the check, and it must not import
the agent rollouts (`agents`) or the engine-set API (`vllm_engine`) to get it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from engines.errors import EngineSpecError

INSTALL_HINT = "pip install --no-deps openrlhf==0.11.2"


def check_agent_func_path(path: Any) -> None:
    """Before any engine exists: OpenRLHF's agent code importable, and `path`
    a Python file whose `AgentExecutor` is an `AgentExecutorBase` (the file is
    loaded once here for that, as the engine loads it again)."""
    if importlib.util.find_spec("openrlhf") is None:
        raise EngineSpecError(
            f"agent_func_path={path!r} runs OpenRLHF's agent executors, and the package "
            f"openrlhf is not installed: {INSTALL_HINT}"
        )
    if not isinstance(path, str) or not path.endswith(".py"):
        raise EngineSpecError(f"agent_func_path={path!r} must be a Python file (.py)")
    if not os.path.isfile(path):
        raise EngineSpecError(f"agent_func_path={path!r} does not exist")
    load_agent_executor(path)


def load_agent_executor(path: str | None) -> Any:
    """OpenRLHF's executor for `path`: its `_load_agent_executor`
    (trainer/ray/vllm_engine.py, which imports vLLM at its top, so mirrored
    here) with errors naming the file, or `SingleTurnAgentExecutor()` for None
    (OpenRLHF's default; its `remote_rm_url` is refused by our engines)."""
    from openrlhf.utils.agent import AgentExecutorBase, SingleTurnAgentExecutor

    if path is None:
        return SingleTurnAgentExecutor()
    spec = importlib.util.spec_from_file_location("agent_module", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise EngineSpecError(f"agent_func_path={path!r} failed to load: {exc!r}") from exc
    executor = getattr(module, "AgentExecutor", None)
    if not (isinstance(executor, type) and issubclass(executor, AgentExecutorBase)):
        raise EngineSpecError(
            f"agent_func_path={path!r} must define a class AgentExecutor that inherits "
            f"openrlhf.utils.agent.AgentExecutorBase, got {executor!r}"
        )
    return executor()
