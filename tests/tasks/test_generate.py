"""Dynamic sampling's bookkeeping over an iteration's rounds (no Ray): which
prompts a refill round samples, and when the batch is full."""

from __future__ import annotations

from tasks.generate import Refill


def rows(signal: list[int], flat: list[int], reward: float = 0.5) -> list[dict]:
    """A round's rows, two samples per group."""
    return [
        {"prompt_index": p, "filtered": p in flat, "reward": reward}
        for p in sorted(signal + flat)
        for _ in range(2)
    ]


def test_a_refill_samples_again_the_prompts_that_showed_signal():
    refill = Refill(batch=6)
    assert refill.next_round(rows(signal=[1, 4], flat=[0, 2, 3, 5])) == [1, 4]
    assert refill.next_round(rows(signal=[1], flat=[4])) == [1, 4]
    # Five groups with signal: one more wanted, one prompt asked.
    assert refill.next_round(rows(signal=[1, 4], flat=[])) == [1]
    assert refill.next_round(rows(signal=[1], flat=[])) == []
    assert refill.signal == [1, 4, 1, 1, 4, 1]
    assert refill.filtered == 5


def test_with_no_signal_anywhere_the_filtered_prompts_go_again():
    refill = Refill(batch=3)
    assert refill.next_round(rows(signal=[], flat=[0, 1, 2], reward=1.0)) == [0, 1, 2]
    assert refill.next_round(rows(signal=[2], flat=[0, 1], reward=0.0)) == [2]
    # The rewards kept are the iteration's own (round 0), for its curve.
    assert refill.rewards == [1.0] * 6


def test_a_round_never_asks_for_more_than_the_batch_lacks():
    refill = Refill(batch=4)
    assert refill.next_round(rows(signal=[0, 1, 2], flat=[3])) == [0]
    assert refill.next_round(rows(signal=[0], flat=[])) == []
