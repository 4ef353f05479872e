"""Agents in the rollout flow, on the tiny model (CPU): the tool task's
agent through the engines' OpenAI endpoint and the run's router learns, its
rows hold the turns and masks. OpenRLHF's agent file in the flow:
tests/flows/test_openrlhf_agent_flow.py (a file of its own, so that the
suite's two workers each take one of these slow runs)."""

from __future__ import annotations

import os
import random
import threading
from types import SimpleNamespace

from rollout_support import REPO, kill_engine, nothing_left, run_dirs, run_params, small_run
from transformers import AutoTokenizer
from waiting import wait_until

from agents import tool_task
from agents.loading import AgentRef
from agents.router.proxy import SessionDefaults
from flows.rollout import rollout
from flows.side_actors import SideActors
from tasks.run.scope import RunScope
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
    requests that set none (agents/router/proxy.py fills them in); the
    router and a runner per engine node are named for the run's sweep."""
    import agents.router.actor
    import flows.side_actors

    started = {}

    def start_router(engines, api_key, routing, defaults, start_timeout_s, name, namespace):
        started.update(routing=routing, defaults=defaults, router=name)
        return SimpleNamespace(url="http://router", actor="actor")

    def start_runners(plan, nodes, names, namespace, timeout_s):
        started.update(nodes=nodes, runners=names, runners_see=plan.router)
        return "runners"

    monkeypatch.setattr(agents.router.actor, "start_router", start_router)
    monkeypatch.setattr(flows.side_actors, "start_runners", start_runners)
    monkeypatch.setattr(flows.side_actors, "engine_nodes", lambda pool: ["n1", "n2"])

    class Engines(list):
        api_key = "k"

    params = run_params(agent="agents.tool_task:agent", max_tokens=12, temperature=0.3)
    side = SideActors(params, RunScope("r", 1), "tiny")
    plan = side.agent_plan(SimpleNamespace(engines=Engines()))
    assert started == {
        "routing": "sticky",
        "defaults": SessionDefaults(12, 0.3),
        "router": "rf-r-a1-router",
        "nodes": ["n1", "n2"],
        "runners": ["rf-r-a1-runner0", "rf-r-a1-runner1"],
        "runners_see": "actor",
    }
    assert isinstance(plan.agent, AgentRef) and str(plan.agent) == "agents.tool_task:agent"
    assert (plan.router_url, plan.api_key, plan.router) == ("http://router", "k", "actor")
    assert plan.runners == side.runners == "runners"


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
    # The rows' structure, from every iteration's sessions.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    sessions: dict[tuple[int, str], list[dict]] = {}
    for i in range(TOOL_TASK["iterations"]):
        for row in read_rows(tmp_path / summary.run_id / f"iter-{i:03d}"):
            sessions.setdefault((i, row["session_id"]), []).append(row)
    # A session that called the tool is one sample of three turns, or two
    # pieces: the router splits it where the agent's re-sent first reply
    # renders to other tokens than were sampled (a sampled byte that is not
    # UTF-8 comes back as U+FFFD), which the byte-level tiny model often does.
    called = [
        pieces for pieces in sessions.values() if len(pieces) > 1 or len(pieces[0]["turns"]) >= 3
    ]
    assert called, "no session called the tool"
    for pieces in called:
        for row in pieces:
            for turn in row["turns"]:
                mask = row["loss_mask"][turn["start"] : turn["stop"]]
                assert set(mask) <= ({1} if turn["role"] == "assistant" else {0}), (turn, mask)
            assert row["session_id"] and row["reward"] >= tool_task.CALL_BONUS
        result = f"tool: {tool_task.lookup(pieces[0]['label'])}"
        if len(pieces) == 1:
            (row,) = pieces
            roles = [turn["role"] for turn in row["turns"]]
            assert roles == ["assistant", "environment", "assistant"], roles
            tool = row["turns"][1]
            environment = row["response_token_ids"][tool["start"] : tool["stop"]]
            # The tool's result is in the stream as the environment's tokens.
            assert result in tokenizer.decode(environment)
        else:
            assert len(pieces) == 2, pieces
            first, second = sorted(pieces, key=lambda row: row["split_reason"] is not None)
            assert first["split_reason"] is None, pieces
            assert second["split_reason"].startswith("turn 2: its prompt leaves"), second
            assert [t["role"] for t in first["turns"] + second["turns"]] == ["assistant"] * 2
            # The new piece starts with the history as rendered: the tool's result in it.
            assert result in tokenizer.decode(second["prompt_token_ids"])


#: The seed of the moment the engine-death test kills an engine (set
#: RF_AGENT_KILL_SEED to run it at other moments, e.g. in a loop:
#: `for s in $(seq 0 9); do RF_AGENT_KILL_SEED=$s pytest ...; done`).
KILL_SEED = int(os.environ.get("RF_AGENT_KILL_SEED", "3"))
#: 16 prompts in shards of 2.
SHARDS = 8


def test_an_agent_run_survives_an_engine_killed_at_a_random_moment(ray_local, tiny_model, tmp_path):
    """An engine killed during an `--agent` training run (its iteration,
    engine and moment drawn from KILL_SEED): after 1 to 7 of an iteration's
    8 shards its sessions use it, and the router moves them to the other
    engine, the round's end fails it in the pool, the retry replaces it,
    syncs it and routes to it; after iteration 0's last shard it dies in the
    policy step or the sync, which replaces it. Every (prompt, sample) is
    written once, by one session, each iteration at its own version, and
    nothing is left."""
    rng = random.Random(KILL_SEED)
    iteration, index = rng.choice([0, 1]), rng.choice([0, 1])
    after = rng.randint(1, SHARDS if iteration == 0 else SHARDS - 1)
    drawn = f"seed {KILL_SEED}: engine {index} after {after} shards of iteration {iteration}"
    run = small_run(tiny_model, tmp_path, num_engines=2, shard_size=2, shards_per_engine=2)
    params = run_params(**{**run, **TOOL_TASK, "iterations": 2, "n": 2})
    killed: list[str] = []

    def kill() -> None:
        (run_dir,) = wait_until(lambda: run_dirs(tmp_path), 300, "the run directory")
        shards = f"iter-{iteration:03d}/shard-*"
        wait_until(lambda: len(list(run_dir.glob(shards))) >= after, 900, f"{after} shards")
        killed.append(kill_engine(run_dir.name, index))

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    state = rollout(params, return_state=True)
    killer.join(timeout=30)
    assert killed, f"not killed ({drawn})"
    assert state.is_completed(), f"{drawn}: {state.message}"
    run_id = str(state.state_details.flow_run_id)
    for i in range(2):
        rows = read_rows(tmp_path / run_id / f"iter-{i:03d}")
        sessions: dict[tuple[int, int], set[str]] = {}
        pieces = set()
        for row in rows:
            sessions.setdefault((row["prompt_index"], row["sample_index"]), set()).add(
                row["session_id"]
            )
            piece = (row["session_id"], tuple(row["response_token_ids"]))
            assert piece not in pieces, f"iteration {i}: {piece[0]} written twice"
            pieces.add(piece)
            assert set(row["weight_versions"]) == {i}, (i, row["weight_versions"])
        assert sorted(sessions) == [(p, s) for p in range(16) for s in range(2)]
        assert all(len(ids) == 1 for ids in sessions.values()), sessions
    nothing_left(run_id)
