"""The policy-step benchmark (benchmarks/policy_step.py) on the CPU: its
groups have the long tail's shape, and a run prints and writes its figures."""

from __future__ import annotations

import json

import pytest

from benchmarks import policy_step
from training.long_tail import make_rows
from training.rollouts import RolloutGroup


def test_the_groups_are_the_long_tails_rows_each_sample_its_rows_length():
    groups = policy_step.make_groups(prompts=20, n=3, scale=32, seed=1, vocab=259)
    rows = make_rows(20, seed=1, scale=32)
    assert len(groups) == 20
    for group, row in zip(groups, rows, strict=True):
        RolloutGroup.model_validate(group)  # what train_step takes
        lengths = {len(s["completion_token_ids"]) for s in group["samples"]}
        assert lengths == {row["max_tokens"]} and len(group["samples"]) == 3


def test_a_run_on_the_cpu_writes_its_step_times_and_leaves_no_folder(tmp_path, own_tmp, capsys):
    out = tmp_path / "step.json"
    policy_step.main(
        ["--scale", "32", "--prompts", "4", "--n", "2", "--steps", "1", "--rows", "3"]
        + ["--json", str(out)]
    )
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and len(result["steps_s"]) == 1
    groups = policy_step.make_groups(4, 2, 32, 0, vocab=259)
    assert result["tokens"] == sum(
        len(s["prompt_token_ids"]) + len(s["completion_token_ids"])
        for g in groups
        for s in g["samples"]
    )
    assert "Self CPU time total" in capsys.readouterr().out  # the profiler's table
    assert not list(own_tmp.glob("policy-step-*"))  # (torch keeps its own cache there)


def test_no_steps_is_refused():
    with pytest.raises(SystemExit):
        policy_step.main(["--steps", "0"])


def test_autocast_times_both_steps_alternating(tmp_path, capsys):
    out = tmp_path / "step.json"
    policy_step.main(
        ["--scale", "32", "--prompts", "2", "--n", "2", "--steps", "2", "--rows", "1"]
        + ["--autocast", "--json", str(out)]
    )
    result = json.loads(out.read_text())
    assert len(result["steps_s"]) == len(result["autocast_steps_s"]) == 2
    printed = capsys.readouterr().out
    steps = [line.split(":")[0] for line in printed.splitlines() if line.startswith("step ")]
    assert steps == ["step 1, float32", "step 1, bf16 autocast"] + [
        "step 2, float32",
        "step 2, bf16 autocast",
    ]
    assert "median step: float32" in printed and "of float32" in printed
