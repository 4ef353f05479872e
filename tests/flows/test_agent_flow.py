"""Agents in the rollout flow, on the tiny model (CPU): the tool task's
agent through the engines' OpenAI endpoint and the run's router learns, its
rows hold the turns and masks. OpenRLHF's agent file in the flow:
tests/flows/test_openrlhf_agent_flow.py (a file of its own, so that the
suite's two workers each take one of these slow runs)."""

from __future__ import annotations

from types import SimpleNamespace

from rollout_support import REPO, run_params, small_run
from transformers import AutoTokenizer

from agents import tool_task
from agents.loading import AgentRef
from agents.router.proxy import SessionDefaults
from flows.rollout import rollout
from flows.side_actors import SideActors
from tasks.run.shards import read_rows

#: `make run-agent`'s parameters (the CLI's demo preset under --agent).
TOOL_TASK = {
    "prompts_path": str(REPO / "data" / "tool_task.jsonl"),
    "label_field": "answer",
    "id_field": "id",
    "agent": "agents.tool_task:agent",
    "iterations": 6,
    "learning_rate": 0.03,
    "n": 8,
}


def test_the_runs_sampling_is_its_agent_sessions_default(monkeypatch):
    """--max-tokens and --temperature reach the router, for the sessions'
    requests that set none (agents/router/proxy.py fills them in)."""
    import agents.router.actor

    started = {}

    def start_router(engines, api_key, routing, defaults):
        started.update(routing=routing, defaults=defaults)
        return SimpleNamespace(url="http://router", actor="actor")

    monkeypatch.setattr(agents.router.actor, "start_router", start_router)

    class Engines(list):
        api_key = "k"

    params = run_params(agent="agents.tool_task:agent", max_tokens=12, temperature=0.3)
    plan = SideActors(params, None, "tiny").agent_plan(SimpleNamespace(engines=Engines()))
    assert started == {"routing": "sticky", "defaults": SessionDefaults(12, 0.3)}
    assert isinstance(plan.agent, AgentRef) and str(plan.agent) == "agents.tool_task:agent"
    assert (plan.router_url, plan.api_key, plan.router) == ("http://router", "k", "actor")


def test_the_tool_task_learns_in_the_flow_and_rows_show_turns_and_masks(
    ray_local, tiny_model, tmp_path
):
    # One shard in flight: each prompt's sessions run in a Ray task, and two
    # shards' worth of tasks (16) started workers past Ray's idle pool, each
    # importing the agent's modules again (twice the CPU, measured).
    run = small_run(tiny_model, tmp_path, num_engines=1, shards_per_engine=1)
    params = run_params(**{**run, **TOOL_TASK})
    state = rollout(params, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    rewards = [step.mean_reward for step in summary.training]
    assert rewards[-1] - rewards[0] > 0.15, rewards
    # The rows' structure, from every iteration: a session the router split
    # (its pieces hold fewer turns each) may be the last one's only caller.
    rows = [
        row
        for i in range(TOOL_TASK["iterations"])
        for row in read_rows(tmp_path / summary.run_id / f"iter-{i:03d}")
    ]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    called = [row for row in rows if len(row["turns"]) >= 3]
    assert called, "no session called the tool and answered in one sample"
    for row in called:
        roles = [turn["role"] for turn in row["turns"]]
        assert roles[:3] == ["assistant", "environment", "assistant"], roles
        for turn in row["turns"]:
            mask = row["loss_mask"][turn["start"] : turn["stop"]]
            assert set(mask) <= ({1} if turn["role"] == "assistant" else {0}), (turn, mask)
        tool = row["turns"][1]
        environment = row["response_token_ids"][tool["start"] : tool["stop"]]
        # The tool's result is in the stream as the environment's tokens.
        assert f"tool: {tool_task.lookup(row['label'])}" in tokenizer.decode(environment)
        assert row["session_id"] and row["reward"] >= tool_task.CALL_BONUS
