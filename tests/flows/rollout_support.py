"""Helpers of the flow tests: small runs, waiting, and looking at what a run
left on the cluster (through Ray itself, not through the flow's bookkeeping)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import ray
from faults import end_generation_thread
from waiting import wait_until

from flows.params import RolloutParams, sectioned

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "data" / "prompts.jsonl"
NUM_PROMPTS = 32


def small_run(model: str, output_dir: Path, address: str | None = None, **overrides) -> dict:
    """Parameters of a quick run on the tiny model."""
    params = {
        "prompts_path": str(PROMPTS),
        "model": model,
        "output_dir": str(output_dir),
        "num_engines": 2,
        "n": 2,
        "max_len": 128,
        "max_tokens": 8,
        "shard_size": 8,
        "ready_timeout_s": 300,
        "request_timeout_s": 120,
        "output_format": "jsonl",  # `written_shards` watches JSONL shards appear
    }
    if address:
        params["address"] = address
    run = {**params, **overrides}
    if run.get("schedule") == "partial":
        # Partial rollouts write an iteration as one shard: the run refuses these.
        for name in ("shard_size", "shards_per_engine"):
            run.pop(name, None)
    return run


def run_params(**values) -> RolloutParams:
    """The run's parameters from fields given by name, as the CLI's flags."""
    return RolloutParams.model_validate(sectioned(values))


def long_run(model: str, output_dir: Path, address: str | None = None, **overrides) -> dict:
    """A run whose generation lasts seconds, in many small shards: long enough
    to kill an engine, cancel or SIGTERM it mid-generation."""
    return small_run(
        model,
        output_dir,
        address,
        **{
            "shard_size": 1,
            "shards_per_engine": 1,
            "max_len": 256,
            "max_tokens": 150,
            "ignore_eos": True,
            **overrides,
        },
    )


def run_dirs(output_dir: Path) -> list[Path]:
    return (
        [p for p in Path(output_dir).iterdir() if p.is_dir()] if Path(output_dir).exists() else []
    )


def written_shards(output_dir: Path, iteration: int = 0) -> list[Path]:
    return sorted(Path(output_dir).glob(f"*/iter-{iteration:03d}/shard-*.jsonl"))


def run_objects(run_id: str) -> dict[str, list[str]]:
    """Every named actor and live placement group that mentions the run id."""
    actors = [
        f"{a['namespace']}/{a['name']}"
        for a in ray.util.list_named_actors(all_namespaces=True)
        if run_id in a["name"] or run_id in a["namespace"]
    ]
    groups = [
        info["name"]
        for info in ray.util.placement_group_table().values()
        if run_id in (info.get("name") or "") and info.get("state") != "REMOVED"
    ]
    return {"actors": actors, "placement_groups": groups}


def nothing_left(run_id: str, timeout_s: float = 30.0) -> None:
    """Assert that the run leaves no actor and no placement group (allowing
    Ray a moment to finish removals already under way)."""
    empty = {"actors": [], "placement_groups": []}
    deadline = time.monotonic() + timeout_s
    while run_objects(run_id) != empty and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run_objects(run_id) == empty


def kill_engine(run_id: str, index: int, actor: bool = True) -> str:
    """Kill engine `index` of the run's current attempt, as a crash would:
    its actor, or (`actor=False`) only its engine, under the live actor."""
    namespace = f"rolloutflow-{run_id}"
    names = sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].endswith(f"-{index}")
    )
    assert names, f"no engine {index} of run {run_id} to kill"
    handle = ray.get_actor(names[-1], namespace=namespace)
    if actor:
        ray.kill(handle, no_restart=True)
    else:
        end_generation_thread(handle)
    return names[-1]


def kill_during_iteration(
    output_dir: Path, iteration: int, index: int, killed: list[str]
) -> threading.Thread:
    """A started thread that kills engine `index` once the run under
    `output_dir` wrote its first shard of `iteration`; appends the name."""

    def kill() -> None:
        wait_until(lambda: run_dirs(output_dir), 120, "the run directory")
        (run_dir,) = run_dirs(output_dir)
        shards = f"iter-{iteration:03d}/shard-*"
        wait_until(lambda: list(run_dir.glob(shards)), 300, f"iteration {iteration}")
        killed.append(kill_engine(run_dir.name, index))

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def rows_by_prompt(rows: list[dict]) -> dict[tuple[int, int], dict]:
    """Rows keyed by (prompt, sample); fails on a duplicate."""
    keyed: dict[tuple[int, int], dict] = {}
    for row in rows:
        key = (row["prompt_index"], row["sample_index"])
        assert key not in keyed, f"duplicate rollout {key}"
        keyed[key] = row
    return keyed
