"""An agent run's shards: each prompt's `n` samples are agent sessions
(agents/runner.py), sent to one of the run's warm runners in one call per
prompt; every sample a session made is a row carrying the session's reward.

An engine that dies under an `--agent` run's sessions is found by the router
(a lost connection, the actor not answering): the router moves the sessions
it held to the engines left (their next turn, or the turn in flight, goes
there). The dispatch never sees that engine fail (its shards' calls go to the
runners), so once a round is written the engines the router found dead are
failed in the pool and the round ends with `EngineDeadError`: the task's
retry replaces them, syncs them to the policy's weights, routes to them and
finds every shard written."""

from __future__ import annotations

import functools
import uuid
from typing import Any

from agents.runner import ROUTER_CALL_TIMEOUT_S
from engines import EngineDeadError
from engines.client import get
from tasks.run.records import trajectory_row, with_input
from tasks.run.shards import Shard
from tasks.run.writer import ShardWriter, add_advantages


class AgentWriter(ShardWriter):
    """A session the router split gives one row per piece, each with the
    whole session's reward (the agent scores the session, not a piece), so
    it weighs in its prompt's group once per piece."""

    def run_round(self, round_: int, order: list[int]) -> list[Shard]:
        router = self.plan.agent.router
        if router is not None:
            # The pool's engines as they are now: one replaced since the last
            # round (by this task's retry, or by a sync) serves under its name
            # at another URL; the router takes it as alive again there.
            timeout_s = self.plan.cluster.ready_timeout_s
            get(router.set_engines.remote(list(self.pool.engines), timeout_s), timeout_s)
        shards = super().run_round(round_, order)
        if router is not None:
            self.fail_dead_engines()
        return shards

    def fail_dead_engines(self) -> None:
        """Fail in the pool the engines the router found dead, and raise."""
        stats = get(self.plan.agent.router.stats.remote(), ROUTER_CALL_TIMEOUT_S, "the router")
        dead = {engine.name for engine in stats.engines if not engine.alive}
        found = [i for i in range(len(self.pool)) if self.pool.name(i) in dead]
        if not found:
            return
        names = [self.pool.name(i) for i in found]
        error = EngineDeadError(
            f"the router lost {names} and moved their sessions; their shards are written, "
            "the engines are replaced next",
            names[0],
        )
        for index in found:
            self.pool.mark_failed(index, error)
        raise error

    def submit(self, engine: int, shard: Shard) -> list:
        handle = self.pool.engines[engine]
        runners = self.plan.agent.runners
        refs = []
        for i in self.order[shard.start : shard.stop]:
            record = self.prompts.records[i]
            row = {"id": record.id, "prompt": record.prompt, "label": record.label}
            sessions = [
                f"i{self.plan.iteration}-r{self.round}-p{i}-s{k}-{uuid.uuid4().hex[:8]}"
                for k in range(self.plan.sampling.n)
            ]
            runner = runners.pick(i)
            refs.append(runner.run_prompt.remote(handle, {**row, **record.metadata}, sessions))
        return refs

    @functools.cached_property
    def tokenizer(self) -> Any:
        # Loaded once per iteration, not per shard; decoded here: in the
        # sessions' Ray worker, AutoTokenizer failed to import the model's config class.
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.plan.agent.model)

    def rows_of(self, shard: Shard, results: list) -> list[dict[str, Any]]:
        tokenizer = self.tokenizer
        rows = []
        prompts = self.order[shard.start : shard.stop]
        for i, sessions in zip(prompts, results, strict=True):
            record = self.prompts.records[i]
            for k, session in enumerate(sessions):
                for sample in session.samples:
                    row = trajectory_row(
                        sample,
                        iteration=self.plan.iteration,
                        prompt_index=i,
                        sample_index=k,
                        prompt=record.prompt,
                        response=tokenizer.decode(sample.response_token_ids),
                        session_id=session.session_id,
                        seed=self.seed_of(i),
                    )
                    row.update(reward=session.reward, refill_round=self.round)
                    rows.append(with_input(row, record))
        add_advantages(rows, filtering=self.plan.max_refill_rounds is not None)
        return rows
