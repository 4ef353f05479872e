"""The partial runner's tests' engines and groups: two CPU engines of the
tiny model, a long group and a short one."""

from __future__ import annotations

import ray

from engines.sampling import SamplingParams
from tasks.partial.runner import SegmentRunner
from tasks.partial.segments import GroupState, SampleState
from tasks.run.pool import EnginePool

MAX_LEN = 2048
LONG, SHORT = 400, 8
#: A long group's budget for a test that kills its engine mid-generation:
#: about 3 s of the tiny model's decoding on the CPU box, where LONG's took
#: 0.6 s after the batch completed, a window a kill on a busy box can miss.
KILLED_LONG = MAX_LEN - 64
SAMPLING = SamplingParams(n=2, temperature=1.0, ignore_eos=True, logprobs=0, max_tokens=LONG)
TEXTS = ["Write lowercase letters after abc", "Write lowercase letters after xyz"]


def groups(long: int = LONG) -> list[GroupState]:
    """A long group and a short one: the short completes the batch of one."""
    return [
        GroupState(0, slot, slot, 100 + slot, [SampleState(k, budget) for k in range(2)])
        for slot, budget in ((0, long), (1, SHORT))
    ]


def runner(pool: EnginePool) -> SegmentRunner:
    return SegmentRunner(pool, TEXTS, SAMPLING, batch=1, timeout_s=300, abort_timeout_s=60)


def still_generating(runner: SegmentRunner) -> bool:
    """Whether a segment of `runner` is not yet answered."""
    flights = list(runner.flights)
    ready, _ = ray.wait(flights, num_returns=len(flights), timeout=0) if flights else ([], [])
    return len(ready) < len(flights)
