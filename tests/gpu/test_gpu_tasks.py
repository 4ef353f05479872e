"""The labelled task through vLLM: chat messages rendered with the model's
chat template, stop strings, rewards scored in Ray; every row's reward and
advantage match a recomputation from the row itself."""

from __future__ import annotations

import json

import pytest
from gpu_helpers import wait_gpus_released
from test_gpu_flow import run_flow_cli

from tasks.run.shards import read_rows
from training.grpo import group_advantages
from training.letter_task import make_rows, score_one

pytestmark = pytest.mark.gpu

#: Ten one-character stop strings: a random model's 48 tokens hit one most
#: of the time (1 - (1 - 10/320)^48 is about 0.8), so stops are exercised.
STOPS = list("0123456789")


def test_letter_task_through_vllm_with_chat_template_and_stops(
    ray_gpu, gpu_model, gpu_count, gpu_baseline, tmp_path
):
    # The policy takes a GPU of its own: on one GPU the run only scores (train
    # false), which still covers the template, the stops and the rewards.
    on_policy = gpu_count >= 2
    rows = make_rows(16, seed=3)
    dataset = tmp_path / "letters.jsonl"
    dataset.write_text(
        "".join(
            json.dumps(
                {
                    "uid": row["id"],
                    "messages": [{"role": "user", "content": row["prompt"]}],
                    "answer": row["answer"],
                    "data_source": row["data_source"],
                }
            )
            + "\n"
            for row in rows
        )
    )
    iterations = 2 if on_policy else 1
    run_flow_cli(
        ray_gpu,
        gpu_model,
        tmp_path,
        "--prompts-path", str(dataset),
        "--prompt-field", "messages",
        "--label-field", "answer",
        "--id-field", "uid",
        "--apply-chat-template",
        "--stop", json.dumps(STOPS),
        "--num-engines", "1",
        "--reward", "training.letter_task:reward",
        "--learning-rate", "0.001",
        "--n", "4",
        "--max-tokens", "48",
        "--iterations", str(iterations),
        "--train" if on_policy else "--no-train",
        "--output-format", "parquet",
        timeout_s=540,
    )  # fmt: skip

    (run_dir,) = (tmp_path / "out").iterdir()
    by_id = {row["id"]: row for row in rows}
    stopped = 0
    for i in range(iterations):
        out = read_rows(run_dir / f"iter-{i:03d}")
        assert len(out) == len(rows) * 4
        groups: dict[int, list[dict]] = {}
        for row in out:
            source = by_id[row["id"]]
            assert row["label"] == source["answer"]
            assert row["data_source"] == "letter_task"
            assert row["prompt"] == f"user: {source['prompt']}\nassistant: "
            assert not any(stop in row["response"] for stop in STOPS), row["response"]
            stopped += row["finish_reason"] == "stop"
            assert row["reward"] == pytest.approx(score_one(row["response"], row["label"]))
            groups.setdefault(row["prompt_index"], []).append(row)
        for group in groups.values():
            group.sort(key=lambda r: r["sample_index"])
            expected = group_advantages([r["reward"] for r in group])
            assert [r["advantage"] for r in group] == pytest.approx(expected)
    assert stopped > 0, "no response ended at a stop string"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["training"]) == (iterations if on_policy else 0)
    assert all(step["reward_seconds"] >= 0 for step in summary["training"])
    wait_gpus_released(gpu_baseline)
