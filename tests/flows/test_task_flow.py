"""The rollout flow on a labelled task with bad input: a bad row fails the
run before anything is created, naming its line; a reward that raises,
returns NaN or the wrong count fails it naming the sample and the value.
Either way nothing is left on the cluster."""

from __future__ import annotations

import json
import re

import pytest
from rollout_support import REPO, nothing_left, run_dirs, run_params, small_run

from flows.rollout import rollout
from tasks.run.prompts import PromptsFileError
from training.rewards import RewardError

LETTERS = REPO / "data" / "letter_task.jsonl"


def run(model, tmp_path, **overrides):
    task = {"prompts_path": str(LETTERS), "label_field": "answer", "id_field": "id"}
    params = run_params(
        **small_run(model, tmp_path / "out", **{**task, "num_engines": 1, **overrides})
    )
    state = rollout(params, return_state=True)
    assert state.is_failed(), state
    return state


@pytest.mark.parametrize(
    ("rows", "overrides", "message"),
    [
        (
            [{"id": "a", "prompt": "x", "answer": "a"}, {"id": "b", "prompt": "y"}],
            {},
            "line 2: no field 'answer'",
        ),
        (
            [{"id": "a", "prompt": [{"role": "user"}], "answer": "a"}],
            {"apply_chat_template": True},
            "line 1: field 'prompt': message 0 needs a string 'content'",
        ),
    ],
)
def test_a_bad_row_fails_before_anything_is_created(
    ray_local, tiny_model, tmp_path, rows, overrides, message
):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    state = run(tiny_model, tmp_path, prompts_path=str(path), **overrides)
    with pytest.raises(PromptsFileError, match=re.escape(f"{path} {message}")):
        state.result()
    assert run_dirs(tmp_path / "out") == []  # not even the run's directory
    nothing_left(str(state.state_details.flow_run_id))


@pytest.mark.parametrize(
    ("reward", "pattern"),
    [
        (
            # Either shard in flight may fail first: its first samples are named.
            "raises",
            re.escape("raised on a batch of 16 samples (id='letter-")
            + r"(\d{4})' sample 0, id='letter-\1' sample 1, id='letter-\d{4}' sample 0, "
            + re.escape("...): RuntimeError: verifier down"),
        ),
        ("nan_for_one", re.escape("gave nan for id='letter-0003' sample 1: not a finite number")),
        ("one_short", re.escape("returned 15 values for 16 samples")),
    ],
)
def test_a_bad_reward_fails_the_run_naming_the_sample(
    ray_local, tiny_model, tmp_path, reward, pattern
):
    path = f"{REPO / 'tests' / 'flows' / 'bad_rewards.py'}:{reward}"
    state = run(tiny_model, tmp_path, reward=path, n=2, max_tokens=4)
    with pytest.raises(RewardError, match=re.escape(f"reward {path} ") + pattern):
        state.result()
    nothing_left(str(state.state_details.flow_run_id))


def test_score_only_run_scores_rows_and_starts_no_policy(ray_local, tiny_model, tmp_path):
    """`train=False`: an evaluation run; rows carry the verifier's rewards and
    no policy actor is started (the flow's resources need no policy slot)."""
    from tasks.run.shards import read_rows
    from training.letter_task import score_one

    task = {"prompts_path": str(LETTERS), "label_field": "answer", "id_field": "id"}
    params = run_params(
        **small_run(
            tiny_model,
            tmp_path / "out",
            **task,
            num_engines=1,
            reward="training.letter_task:reward",
            train=False,
            n=2,
            max_tokens=4,
        )
    )
    summary = rollout(params)
    assert summary.training == []
    (run_dir,) = run_dirs(tmp_path / "out")
    rows = read_rows(run_dir / "iter-000")
    assert len(rows) == 2 * len(LETTERS.read_text().splitlines())
    assert all(row["weight_version"] == 0 for row in rows)
    for row in rows:
        assert row["reward"] == pytest.approx(score_one(row["response"], row["label"]))
    nothing_left(summary.run_id)
