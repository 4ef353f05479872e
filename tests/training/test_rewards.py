"""Rewards: loading by import path, the batch check (count, finite values,
errors naming the sample), the OpenRLHF and verl adapters with rewards
written as their docs show, and rollout grouping."""

from __future__ import annotations

import math
import re
import sys
import types
from pathlib import Path

import pytest

from training.letter_task import make_rows
from training.letter_task import reward as letter_reward
from training.rewards import (
    RewardError,
    RewardInput,
    load_reward,
    score,
    target_chars_fraction,
)
from training.rollouts import groups_from_rows

BAD = Path(__file__).resolve().parents[1] / "flows" / "bad_rewards.py"


def sample(response: str, tokens: int | None = None, **kw) -> RewardInput:
    values = dict(
        id=kw.pop("id", "row-0"),
        sample=0,
        prompt="Q: ",
        response=response,
        prompt_token_ids=[1],
        response_token_ids=list(range(len(response) if tokens is None else tokens)),
    )
    return RewardInput(**values, **kw)


def test_toy_reward_counts_lowercase_letters_per_token():
    samples = [sample("abcd"), sample("aB1 "), sample("ab", 4), sample("")]
    # Tokens that decode to nothing (ids outside the byte alphabet) count as misses.
    assert target_chars_fraction(samples) == [1.0, 0.25, 0.5, 0.0]


def test_letter_task_verifies_against_the_label():
    samples = [sample("b", label="b"), sample("bb", label="b"), sample("ba", label="b")]
    assert letter_reward(samples + [sample("", label="b"), sample("a", label="b")]) == [
        1.0,
        1.0,
        0.5,
        0.0,
        0.0,
    ]
    rows = make_rows(8, seed=1)
    assert all(row["prompt"].endswith(row["answer"]) for row in rows)
    assert len({row["id"] for row in rows}) == 8
    assert make_rows(8, seed=1) == rows  # deterministic


def test_reward_is_loaded_by_import_path():
    assert load_reward("training.rewards:target_chars_fraction") is target_chars_fraction
    with pytest.raises(
        ValueError,
        match="or 'file.py:function', got 'training.rewards.target_chars_fraction'",
    ):
        load_reward("training.rewards.target_chars_fraction")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_reward("no_such_module:f")
    with pytest.raises(ValueError, match="no callable 'nope'"):
        load_reward("training.rewards:nope")
    assert load_reward(f"{BAD}:one_short")([1, 2]) == [0.0]  # a file, as OpenRLHF takes
    with pytest.raises(ValueError, match="cannot import 'nope.py': no file"):
        load_reward("nope.py:f")
    with pytest.raises(ValueError, match="reward style must be one of"):
        load_reward("training.rewards:target_chars_fraction", "trl")


def install(monkeypatch, name: str, **functions) -> str:
    module = types.ModuleType(name)
    for attr, fn in functions.items():
        setattr(module, attr, fn)
    monkeypatch.setitem(sys.modules, name, module)
    return name


def test_openrlhf_reward_runs_unchanged(monkeypatch):
    torch = pytest.importorskip("torch")
    seen = {}

    # As OpenRLHF's examples/python/reward_func.py: queries are prompt +
    # response, the result a dict whose "rewards" is a tensor.
    def reward_func(queries, prompts, labels, **kwargs):
        seen.update(queries=queries, prompts=prompts, labels=labels)
        reward = torch.tensor(
            [float(q.endswith(label)) for q, label in zip(queries, labels, strict=True)]
        )
        return {"rewards": reward, "scores": reward, "extra_logs": {"dummy": reward}}

    # Older OpenRLHF: a bare tensor.
    def reward_tensor(queries, prompts, labels):
        return torch.tensor([len(q) for q in queries], dtype=torch.float)

    module = install(monkeypatch, "orlhf_reward", reward_func=reward_func, r2=reward_tensor)
    samples = [sample("42", label="42"), sample("41", label="42")]
    assert score(load_reward(f"{module}:reward_func", "openrlhf"), samples) == [1.0, 0.0]
    assert seen == {"queries": ["Q: 42", "Q: 41"], "prompts": ["Q: "] * 2, "labels": ["42"] * 2}
    assert score(load_reward(f"{module}:r2", "openrlhf"), samples) == [5.0, 5.0]


def test_verl_compute_score_runs_unchanged(monkeypatch):
    calls = []

    # As verl's custom reward function docs: keyword arguments, a float or a
    # dict with "score".
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append((data_source, solution_str, ground_truth, extra_info))
        if data_source == "dict":
            return {"score": 0.5, "acc": True}
        return 1.0 if solution_str.strip() == ground_truth else 0.0

    module = install(monkeypatch, "verl_reward", compute_score=compute_score)
    samples = [
        sample("4", label="4", metadata={"data_source": "gsm8k", "extra_info": {"index": 3}}),
        sample("5", label="4", metadata={"data_source": "gsm8k"}),
        sample("x", label="4", metadata={"data_source": "dict"}),
    ]
    assert score(load_reward(f"{module}:compute_score", "verl"), samples) == [1.0, 0.0, 0.5]
    assert calls[0] == ("gsm8k", "4", "4", {"index": 3})
    assert calls[1] == ("gsm8k", "5", "4", None)


def test_verl_reward_that_raises_names_the_sample(monkeypatch):
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        raise KeyError(solution_str)

    module = install(monkeypatch, "verl_bad", compute_score=compute_score)
    samples = [sample("x", id="q-17", label="4")]
    with pytest.raises(
        RewardError, match=re.escape("reward raised on id='q-17' sample 0: KeyError")
    ):
        score(load_reward(f"{module}:compute_score", "verl"), samples)


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([1.0], "returned 1 values for 2 samples"),
        ([1.0, math.nan], "gave nan for id='b' sample 0: not a finite number"),
        ([math.inf, 1.0], "gave inf for id='a' sample 0: not a finite number"),
        ([1.0, "high"], "gave 'high' for id='b' sample 0: not a finite number"),
        ([None, 1.0], "gave None for id='a' sample 0: not a finite number"),
    ],
)
def test_bad_reward_values_name_the_sample_and_value(returned, message):
    samples = [sample("x", id="a"), sample("y", id="b")]
    with pytest.raises(RewardError, match=re.escape(f"my-reward {message}")):
        score(lambda batch: returned, samples, "my-reward")


def test_a_raising_batch_reward_names_its_samples():
    def broken(batch):
        raise RuntimeError("verifier down")

    samples = [sample("x", id=i) for i in range(5)]
    with pytest.raises(
        RewardError,
        match=re.escape(
            "r raised on a batch of 5 samples (id=0 sample 0, id=1 sample 0, id=2 sample 0, "
            "...): RuntimeError: verifier down"
        ),
    ):
        score(broken, samples, "r")


def row(prompt_index: int, sample_index: int, text: str, reward: float | None, version=3) -> dict:
    return {
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "prompt_token_ids": [9, 9],
        "response_token_ids": [1] * len(text),
        "response": text,
        "logprobs": [-1.0] * len(text),
        "weight_version": version,
        "reward": reward,
    }


def test_rows_group_by_prompt_in_sample_order_with_their_rewards():
    rows = [row(1, 1, "ab", 1.0), row(0, 0, "XY", 0.0), row(1, 0, "a1", 0.5), row(0, 1, "xy", 1.0)]
    groups = groups_from_rows(rows)
    assert [[s.completion_text for s in g.samples] for g in groups] == [["XY", "xy"], ["a1", "ab"]]
    assert [g.rewards for g in groups] == [[0.0, 1.0], [0.5, 1.0]]
    assert groups[0].samples[0].weight_version == 3
    with pytest.raises(ValueError, match="no reward"):
        _ = groups_from_rows([row(0, 0, "x", None)])[0].rewards


def test_scorer_actor_scores_and_passes_errors_and_deadlines(ray_local):
    import ray

    from training.rewards import RewardTimeoutError, score_remote, start_reward_scorer

    samples = [sample("bb", id="x", label="b"), sample("ab", id="y", label="b")]
    scorers = [
        start_reward_scorer(path, "batch")
        for path in ("training.letter_task:reward", f"{BAD}:nan_for_one", f"{BAD}:slow")
    ]
    good, bad, slow = scorers
    try:
        assert score_remote(good, samples, timeout_s=60) == [1.0, 0.5]
        nan_sample = sample("b", id="letter-0003")
        nan_sample = RewardInput(**{**nan_sample.__dict__, "sample": 1})
        with pytest.raises(RewardError, match=r"gave nan for id='letter-0003' sample 1"):
            score_remote(bad, [nan_sample], timeout_s=60)
        with pytest.raises(RewardTimeoutError, match="no answer within 1.0s for a batch of 2"):
            score_remote(slow, samples, timeout_s=1.0)
    finally:
        for scorer in scorers:
            ray.kill(scorer)
