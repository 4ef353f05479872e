"""The rollout flow in process (Prefect test harness, real local Ray, the
tiny model): the rows it writes, its artifacts, what it leaves behind, and
its refusal of bad input before anything is created."""

from __future__ import annotations

import gc
import json
import re
import threading
import weakref

import pyarrow.parquet as pq
import pytest
import ray
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from rollout_support import (
    NUM_PROMPTS,
    PROMPTS,
    kill_engine,
    long_run,
    nothing_left,
    rows_by_prompt,
    run_dirs,
    run_params,
    small_run,
    written_shards,
)
from waiting import wait_until

from flows.rollout import frozen_heap, rollout
from tasks.run.prompts import PromptsFileError
from tasks.run.shards import read_rows


def artifacts_of(flow_run_id) -> dict[str, list]:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    by_type: dict[str, list] = {}
    for artifact in sorted(found, key=lambda a: a.created):
        by_type.setdefault(artifact.type, []).append(artifact)
    return by_type


def engine_table(flow_run_id) -> list[dict]:
    (table,) = artifacts_of(flow_run_id)["table"]
    data = table.data if isinstance(table.data, list) else json.loads(table.data)
    return data


def test_flow_writes_every_rollout_once(ray_local, tiny_model, tmp_path):
    params = run_params(
        **small_run(tiny_model, tmp_path, iterations=2, logprobs=1, output_format="parquet")
    )
    state = rollout(params, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    flow_run_id = state.state_details.flow_run_id

    assert summary.rows == 2 * NUM_PROMPTS * 2
    assert summary.generate_calls == 2 * NUM_PROMPTS
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    for iteration in (0, 1):
        directory = tmp_path / str(flow_run_id) / f"iter-{iteration:03d}"
        rows = rows_by_prompt(read_rows(directory))
        assert sorted(rows) == [(p, s) for p in range(NUM_PROMPTS) for s in range(2)]
        for (p, _), row in rows.items():
            assert row["prompt"] == prompts[p]
            assert row["iteration"] == iteration
            assert row["seed"] == 42 + iteration * NUM_PROMPTS + p
            assert 1 <= len(row["response_token_ids"]) <= 8
            assert len(row["logprobs"]) == len(row["response_token_ids"])
            assert row["finish_reason"] in ("stop", "length")
            assert row["engine"].startswith(f"rf-{flow_run_id}-a1-")
        assert sum(pq.read_table(p).num_rows for p in directory.glob("*.parquet")) == len(rows)
    assert json.loads((tmp_path / str(flow_run_id) / "summary.json").read_text())["rows"] == 128

    table = engine_table(flow_run_id)
    assert sorted(row["name"] for row in table) == [
        f"rf-{flow_run_id}-a1-0",
        f"rf-{flow_run_id}-a1-1",
    ]
    assert sum(row["prompts"] for row in table) == 2 * NUM_PROMPTS
    assert all(row["restarts"] == 0 and row["startup_s"] > 0 for row in table)
    artifacts = artifacts_of(flow_run_id)
    assert [a.data for a in artifacts["progress"]] == [100.0, 100.0]
    assert "| 1 | 4 | 0 | 64 |" in artifacts["markdown"][0].data
    nothing_left(str(flow_run_id))
    assert ray.is_initialized()  # the test's own Ray is not shut down by the run


def test_engines_killed_at_start_and_mid_generation(ray_local, tiny_model, tmp_path):
    """Engine 0 dies while loading, engine 1 mid-generation: readiness and
    generation each retry with the engine replaced, the run completes, every
    prompt is answered exactly once, and the engine table shows the restarts."""

    def engine_names():
        return [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"].startswith("rolloutflow-") and a["name"].endswith("-a1-0")
        ]

    def kill_two_engines():
        # Engines take seconds to load the model: this kill lands before `ready`.
        wait_until(engine_names, 120, "the engines to be created")
        (run_dir,) = run_dirs(tmp_path)
        killed.append(kill_engine(run_dir.name, 0))
        wait_until(lambda: written_shards(tmp_path), 120, "the first shard")
        killed.append(kill_engine(run_dir.name, 1))

    killed: list[str] = []
    killer = threading.Thread(target=kill_two_engines, daemon=True)
    killer.start()
    state = rollout(run_params(**long_run(tiny_model, tmp_path)), return_state=True)
    killer.join(timeout=5)
    assert state.is_completed(), state.message
    flow_run_id = str(state.state_details.flow_run_id)
    assert killed == [f"rf-{flow_run_id}-a1-0", f"rf-{flow_run_id}-a1-1"]

    rows = rows_by_prompt(read_rows(tmp_path / flow_run_id / "iter-000"))
    assert sorted(rows) == [(p, s) for p in range(NUM_PROMPTS) for s in range(2)]
    assert all(len(row["response_token_ids"]) == 150 for row in rows.values())
    table = {row["name"]: row for row in engine_table(flow_run_id)}
    for name in killed:
        assert (table[name]["restarts"], table[name]["failures"]) == (1, 1), table[name]
        assert "EngineDeadError" in table[name]["last_error"]
    assert sum(row["prompts"] for row in table.values()) == NUM_PROMPTS
    nothing_left(flow_run_id)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "fine"}\n{"prompt": "fine"}\n{"prompt": \n', "{path} line 3: not valid JSON"),
        ("", "prompts file {path} holds no prompts"),
    ],
)
def test_bad_prompts_file_fails_before_anything_starts(ray_local, tmp_path, content, message):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(content)
    before = ray.util.list_named_actors(all_namespaces=True)
    params = run_params(prompts_path=str(bad), output_dir=str(tmp_path / "out"))
    with pytest.raises(PromptsFileError, match=re.escape(message.format(path=bad))):
        rollout(params)
    assert ray.util.list_named_actors(all_namespaces=True) == before
    assert not (tmp_path / "out").exists()


def test_invalid_parameters_name_the_field(tmp_path):
    with pytest.raises(Exception, match="num_engines") as info:
        rollout(params={"engines": {"num_engines": 0}, "output": {"output_dir": str(tmp_path)}})
    assert "greater than or equal to 1" in str(info.value)
    assert not any(tmp_path.iterdir())


def test_parameters_of_the_flat_shape_name_each_field_s_new_place(tmp_path):
    with pytest.raises(Exception, match="num_engines -> engines.num_engines"):
        rollout(params={"num_engines": 4, "output_dir": str(tmp_path)})
    assert not any(tmp_path.iterdir())


def test_the_iterations_run_with_the_heap_frozen_and_unfrozen_after():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0  # what the process held is out of full collections
        # The garbage an iteration makes is still collected.
        made = Cycle()
        made.itself, gone = made, weakref.ref(made)
        del made
        gc.collect()
        assert gone() is None
    assert gc.get_freeze_count() == 0


class Cycle:
    pass


def test_a_heap_frozen_before_the_flow_stays_frozen():
    gc.freeze()
    try:
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0  # not the flow's to undo
    finally:
        gc.unfreeze()
