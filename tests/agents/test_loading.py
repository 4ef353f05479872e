"""Agent functions as the flow takes them: refused before anything starts
when they cannot run, found in the working directory as `python -m` finds
them, and loaded again from their reference where the sessions run."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from agents import tool_task
from agents.loading import AgentRef, check_func_path, load_agent
from flows.params import RolloutParams, sectioned
from flows.rollout import check_settings

REPO = Path(__file__).resolve().parents[2]
AGENT = "async def agent(client, row):\n    return 1.0, {}\n"


def write(tmp_path, text: str) -> str:
    path = tmp_path / "my_agent.py"
    path.write_text(text)
    return str(path)


def test_an_async_function_loads_by_module_or_file(tmp_path):
    assert load_agent("agents.tool_task:agent") is tool_task.agent
    path = write(tmp_path, AGENT)
    assert load_agent(f"{path}:agent").__name__ == "agent"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("agents.tool_task", "must be 'package.module:function'"),
        ("no_such_module_xyz:agent", "cannot import 'no_such_module_xyz'"),
        ("agents.tool_task:nothing", "has no callable 'nothing'"),
        ("agents.tool_task:lookup", "is not async"),
        ("/nowhere/agent.py:agent", "cannot import '/nowhere/agent.py'"),
    ],
)
def test_an_agent_that_cannot_run_is_refused_naming_it(path, message):
    with pytest.raises(ValueError, match=message):
        load_agent(path)


def test_the_flow_checks_the_agent_before_anything_starts(tmp_path):
    def run(**values):
        return RolloutParams.model_validate(sectioned(values))

    with pytest.raises(ValueError, match="is not async"):
        check_settings(run(agent="agents.tool_task:lookup"))
    with pytest.raises(ValueError, match="agent_func_path '/nowhere/agent_func.py'"):
        check_settings(run(agent_func_path="/nowhere/agent_func.py"))
    check_settings(run(agent="agents.tool_task:agent"))
    assert check_func_path(write(tmp_path, "")) == str(tmp_path / "my_agent.py")


def test_a_file_is_made_absolute_once_where_the_agent_is_given(tmp_path, monkeypatch):
    write(tmp_path, AGENT)
    monkeypatch.chdir(tmp_path)
    ref = AgentRef.parse("my_agent.py:agent")
    assert ref == AgentRef(str(tmp_path / "my_agent.py"), "agent")
    assert str(ref) == f"{tmp_path / 'my_agent.py'}:agent"


def test_a_module_in_the_working_directory_loads_as_under_python_m(tmp_path, monkeypatch):
    """`rolloutflow --agent my_agent:agent` from the folder holding my_agent.py:
    the console script does not put that folder on the path."""
    write(tmp_path, AGENT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_agent", raising=False)
    ref = AgentRef.parse("my_agent:agent")
    assert ref.folder == str(tmp_path)
    assert load_agent("my_agent:agent").__name__ == "agent"
    sys.modules.pop("my_agent", None)


def test_a_module_not_found_suggests_the_file_form(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as raised:
        load_agent("my_agent:agent")
    assert "No module named 'my_agent'" in str(raised.value)
    assert f"nor in the working directory {tmp_path}" in str(raised.value)
    assert "'path/to/my_agent.py:agent'" in str(raised.value)


def test_a_missing_import_inside_the_agent_is_not_taken_for_the_agent(tmp_path, monkeypatch):
    write(tmp_path, "import no_such_dependency_xyz\n" + AGENT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_agent", raising=False)
    with pytest.raises(ValueError, match="No module named 'no_such_dependency_xyz'") as raised:
        load_agent("my_agent:agent")
    assert "my_agent.py:agent" not in str(raised.value)
    sys.modules.pop("my_agent", None)


def test_the_reference_travels_and_loads_where_the_working_directory_differs(tmp_path, monkeypatch):
    """What a Ray task that runs sessions gets: the pickled reference, in a
    process started in another folder."""
    agent_dir, elsewhere = tmp_path / "mine", tmp_path / "elsewhere"
    agent_dir.mkdir()
    elsewhere.mkdir()
    write(agent_dir, AGENT)
    monkeypatch.chdir(agent_dir)
    ref = AgentRef.parse("my_agent:agent")
    loads = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read()).load().__name__)"
    done = subprocess.run(
        [sys.executable, "-c", loads],
        input=pickle.dumps(ref),
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        check=True,
    )
    assert done.stdout.decode().strip() == "agent"
