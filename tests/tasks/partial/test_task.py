"""An iteration's groups as plain data: the carried ones, then new ones in
the slots not started beside the step before; the next iteration's groups
that may start beside the policy step, and the wait bound they count by."""

from __future__ import annotations

import pytest

from engines.sampling import SamplingParams
from flows.params import RolloutParams, sectioned
from tasks.partial.segments import GroupState, SampleState
from tasks.partial.task import PartialPlan, group_seed, groups_for, next_groups
from tasks.run.plans import GenerationPlan
from tasks.run.prompts import PromptRecord, Prompts

BATCH, N, IN_FLIGHT = 4, 2, 6
PROMPTS = Prompts("p.jsonl", [PromptRecord(i, f"p{i}", None, {}) for i in range(BATCH)], "", None)


def plan(iteration: int, max_wait: int = 2) -> PartialPlan:
    run = RolloutParams.model_validate(sectioned({"reward": "training.letter_task:reward"}))
    generation = GenerationPlan(
        run_dir="/nonexistent",
        iteration=iteration,
        sampling=SamplingParams(n=N, max_tokens=8),
        base_seed=100,
        output=run.output,
        cluster=run.cluster,
    )
    return PartialPlan(generation, IN_FLIGHT, max_wait, keep_generating=True, start_next=True)


def ran_under(group: GroupState, version: int) -> GroupState:
    """`group` with one segment of its first sample run under `version`."""
    group.samples[0].versions.append(version)
    return group


def test_an_iterations_new_groups_skip_the_slots_started_beside_the_step_before():
    """Carried groups first (oldest first), then the iteration's slots not
    started yet: the same slots, prompts and seeds as a run that started
    none early, so nothing is generated twice and no prompt is skipped."""
    left = [GroupState(0, 5, 1, 105, [SampleState(k, 8) for k in range(N)])]
    early = next_groups(plan(0), PROMPTS, left)[:2]  # two started beside step 0
    groups = groups_for(plan(1), PROMPTS, left + early)
    assert [(g.origin, g.slot) for g in groups] == [(0, 5), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    assert groups[1:3] == early
    plain = groups_for(plan(1), PROMPTS, left)
    assert [(g.slot, g.prompt_index, g.seed) for g in plain[1:]] == [
        (g.slot, g.prompt_index, g.seed) for g in groups[1:]
    ]
    assert groups[3].seed == group_seed(100, 1, 2, IN_FLIGHT)


@pytest.mark.parametrize(
    ("max_wait", "left_origins", "expected"),
    [
        # The next iteration tops up to in_flight: 6 - 2 carried.
        (2, [0, 0], 4),
        # Wait bound 1: what starts early is due next iteration, beside the
        # carried groups due then; together at most a batch (4).
        (1, [0, 0], 2),
        (1, [0, 0, 0, 0], 0),
    ],
)
def test_the_next_groups_started_beside_the_step_fit_its_batch(max_wait, left_origins, expected):
    left = [
        ran_under(GroupState(o, s, s % BATCH, s, [SampleState(k, 8) for k in range(N)]), o)
        for s, o in enumerate(left_origins)
    ]
    started = next_groups(plan(0, max_wait), PROMPTS, left)
    assert [(g.origin, g.slot) for g in started] == [(1, s) for s in range(expected)]


def test_a_group_waits_from_its_oldest_segments_version():
    """A group started beside step 0 for iteration 1 ran under version 0: at
    iteration 2 it has waited 2 iterations, as the policy counts its rows."""
    group = GroupState(1, 0, 0, 7, [SampleState(k, 8) for k in range(N)])
    assert group.waited(2) == 1  # nothing ran yet: from its origin
    ran_under(group, 0)
    assert group.waited(2) == 2
