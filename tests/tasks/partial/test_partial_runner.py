"""Partial rollouts on real engine actors (CPU backend, real Ray): a batch
that completes aborts the long samples with their tokens so far, and a later
segment resumes them from the prompt's and the sample's token ids: across a
weight sync, and across an engine killed while it held the resumed work, a
sample's tokens are exactly those before the stop followed by those the
resumed request made (no re-prefill drift), and each token's version is the
one the engine reported for it."""

from __future__ import annotations

import copy
import threading

import ray
from partial_engines import KILLED_LONG, LONG, SAMPLING, groups, runner, still_generating
from waiting import wait_until

from tasks.partial.segments import GroupState, SampleState
from tasks.run.pool import EnginePool
from tasks.run.records import rows_for


def new_weights(pool: EnginePool, tmp_path) -> None:
    """Version 1 on every engine: the embeddings and head scaled."""
    from transformers import AutoModelForCausalLM

    from engines.weight_sync.transports import checkpoint

    model = AutoModelForCausalLM.from_pretrained(pool.engines.configs[0].pretrain)
    weights = {
        name: tensor * 1.5 if "lm_head" in name or "embed" in name else tensor
        for name, tensor in model.state_dict().items()
    }
    path = checkpoint.save(weights.items(), tmp_path / "v1", version=1)
    ray.get([e.load_checkpoint.remote(str(path), version=1) for e in pool.engines], timeout=120)


def stop_the_long_group(pool: EnginePool) -> tuple[GroupState, list[SampleState]]:
    """Run both groups until the short one completes; the long one is aborted
    part-way. Returns it and a copy of its samples at the stop."""
    long_group, short_group = groups()
    first = runner(pool)
    assert first.run([long_group, short_group]) == [short_group]
    # One request per new group; the long one aborted on its engine.
    assert first.counts.sent == 2 and first.counts.aborted == 2 and not long_group.complete
    for sample in long_group.samples:
        made = len(sample.token_ids)
        assert sample.finish_reason == "abort" and 0 < made < LONG
        assert sample.token_versions == [0] * made and len(sample.positions) == made
    return long_group, copy.deepcopy(long_group.samples)


def replay(pool: EnginePool, engine: int, group: GroupState, at_stop: SampleState):
    """What the resumed segment of `at_stop` makes on `engine`, asked for
    directly: the same prompt ids + tokens so far, budget and seed."""
    params = at_stop.request(SAMPLING, group.seed)
    output = ray.get(pool.engines[engine].generate.remote(at_stop.prompt(), params), timeout=300)
    return output.outputs[0]


def test_a_resumed_sample_is_its_tokens_before_the_sync_then_the_new_weights(pool, tmp_path):
    long_group, stopped = stop_the_long_group(pool)
    new_weights(pool, tmp_path)
    again = runner(pool)
    assert again.run([long_group]) == [long_group]
    assert again.counts.resumed == 2
    rows = rows_for(
        long_group.output("g"),
        iteration=1,
        prompt_index=0,
        prompt="p",
        seed=100,
        with_logprobs=True,
    )
    for sample, before, row in zip(long_group.samples, stopped, rows, strict=True):
        k = len(before.token_ids)
        after = replay(pool, 0, long_group, before)
        assert sample.token_ids == before.token_ids + after.token_ids
        assert len(sample.token_ids) == LONG and sample.finish_reason == "length"
        # Per token: the version the engine reported, before and after the stop.
        assert after.token_versions == [1] * (LONG - k)
        assert row["token_versions"] == before.token_versions + after.token_versions
        assert row["response_token_ids"] == sample.token_ids
        assert row["logprobs"][:k] == [p[0][1] for p in before.positions]
        assert row["logprobs"][k:] == [
            after.logprobs[i][t].logprob for i, t in enumerate(after.token_ids)
        ]
        assert row["weight_versions"] == [0, 1] and row["weight_version"] == 0


def test_an_engine_killed_under_resumed_work_loses_none_of_the_tokens_before(pool, tmp_path):
    long_group, stopped = stop_the_long_group(pool)
    new_weights(pool, tmp_path)
    resumed = runner(pool)
    finished: list = []
    worker = threading.Thread(target=lambda: finished.append(resumed.run([long_group])))
    worker.start()
    # Each engine holds one resumed sample (the least loaded gets the next).
    wait_until(
        lambda: ray.get(pool.engines[0].get_num_unfinished_requests.remote(), timeout=30),
        120,
        "engine 0 to run a resumed sample",
    )
    held = [s.index for f in list(resumed.flights.values()) if f.engine == 0 for s in f.samples]
    ray.kill(pool.engines[0])
    worker.join(timeout=600)
    assert finished == [[long_group]], "the resumed samples did not complete"
    assert 0 in pool.failed and held
    assert resumed.counts.sent == 3  # one per sample, one sent again to the survivor
    for sample, before in zip(long_group.samples, stopped, strict=True):
        after = replay(pool, 1, long_group, before)
        assert sample.token_ids == before.token_ids + after.token_ids
        assert sample.token_versions == before.token_versions + [1] * len(after.token_ids)
    redone = long_group.samples[held[0]]
    assert redone.engines[-1] == pool.name(1)


def test_kept_running_the_rest_generates_until_finish_then_stops_with_its_tokens(pool):
    long_group, short_group = groups()
    kept = runner(pool)
    assert kept.run([long_group, short_group], keep_running=True) == [short_group]
    # The batch is complete and the long group still generates (400 tokens
    # on the CPU engine take far longer than the 8 of the short one).
    assert still_generating(kept) and kept.counts.aborted == 0 and not long_group.complete
    kept.finish()
    assert not kept.flights and not still_generating(kept) and kept.counts.aborted == 2
    for sample in long_group.samples:
        made = len(sample.token_ids)
        assert sample.finish_reason == "abort" and 0 < made < LONG
        assert sample.token_versions == [0] * made and len(sample.positions) == made
    # Nothing of it runs on: both engines are free.
    for engine in pool.engines:
        assert ray.get(engine.get_num_unfinished_requests.remote(), timeout=30) == 0


def test_kept_running_a_batch_complete_from_the_carry_still_sends_the_rest(pool):
    """Carried complete groups can fill the batch before anything is sent:
    kept running, the rest still generates while the policy trains (else the
    engines idle through the step); not kept running, nothing is sent."""
    long_group, short_group = groups()
    for sample in short_group.samples:
        sample.finish_reason = "length"  # complete, as carried from the step before
    kept = runner(pool)
    assert kept.run([short_group, long_group], keep_running=True) == [short_group]
    assert kept.counts.sent == 1 and still_generating(kept)
    kept.finish()
    assert kept.counts.aborted == 2 and not long_group.complete
    stopped = runner(pool)
    assert stopped.run([short_group, groups()[0]]) == [short_group]
    assert stopped.counts.sent == 0 and not stopped.flights


def test_kept_running_past_the_request_deadline_still_stops_with_its_tokens(pool):
    """The rest may keep running through a long policy step, past the
    deadline its requests were sent with: stopping it then is no hang, and
    no engine is lost or token dropped."""
    long_group, short_group = groups()
    kept = runner(pool)
    assert kept.run([long_group, short_group], keep_running=True) == [short_group]
    for flight in kept.flights.values():
        flight.deadline = 0.0  # as after a policy step longer than timeout_s
    kept.finish()
    assert not pool.failed and kept.counts.aborted == 2
    for sample in long_group.samples:
        assert sample.finish_reason == "abort" and 0 < len(sample.token_ids) < LONG


def test_an_engine_killed_while_kept_running_is_dropped_from_the_stop(pool):
    """The engine running the rest dies while the policy trains: the stop
    pauses the survivor only, marks the dead engine failed (the sync then
    replaces it), and its samples stay unfinished, with their tokens before
    the lost segment, to resume elsewhere."""
    long_group, short_group = groups(long=KILLED_LONG)
    kept = runner(pool)
    assert kept.run([long_group, short_group], keep_running=True) == [short_group]
    (dead,) = {flight.engine for flight in kept.flights.values()}
    ray.kill(pool.engines[dead])
    kept.finish()
    assert list(pool.failed) == [dead] and pool.live() == [1 - dead]
    assert not kept.flights and kept.counts.aborted == 0
    assert all(s.token_ids == [] and not s.done for s in long_group.samples)
    survivor = pool.engines[1 - dead]
    assert ray.get(survivor.get_num_unfinished_requests.remote(), timeout=30) == 0
    # The survivor was paused and resumed: it serves.
    again = runner(pool)
    assert again.run([groups()[1]]) and again.counts.sent == 1
