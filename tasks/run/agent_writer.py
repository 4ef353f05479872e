"""An agent run's shards: each prompt's `n` samples are agent sessions
(agents/runner.py), run in one Ray task per prompt; every sample a session
made is a row carrying the session's reward."""

from __future__ import annotations

import functools
import uuid
from typing import Any

from agents.runner import run_prompt
from tasks.run.records import trajectory_row, with_input
from tasks.run.shards import Shard
from tasks.run.writer import ShardWriter, add_advantages


class AgentWriter(ShardWriter):
    """A session the router split gives one row per piece, each with the
    whole session's reward (the agent scores the session, not a piece), so
    it weighs in its prompt's group once per piece."""

    def submit(self, engine: int, shard: Shard) -> list:
        handle = self.pool.engines[engine]
        refs = []
        for i in self.order[shard.start : shard.stop]:
            record = self.prompts.records[i]
            row = {"id": record.id, "prompt": record.prompt, "label": record.label}
            sessions = [
                f"i{self.plan.iteration}-r{self.round}-p{i}-s{k}-{uuid.uuid4().hex[:8]}"
                for k in range(self.plan.sampling.n)
            ]
            refs.append(
                run_prompt.remote(self.plan.agent, handle, {**row, **record.metadata}, sessions)
            )
        return refs

    @functools.cached_property
    def tokenizer(self) -> Any:
        # Loaded once per iteration, not per shard; decoded here: in the
        # sessions' Ray task, AutoTokenizer failed to import the model's config class.
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
