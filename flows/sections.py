"""The flow's own sections of a run's parameters: the on-policy loop
(`TrainingParams`) and agent runs (`AgentsParams`). Each checks its own
values; what one field means beside another (of any section) is checked
once, in the run's table of flag pairs (flows/params.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from flows.schedule import SCHEDULES, Schedule, ScheduleRule
from tasks.run.params import SECTION


class TrainingParams(BaseModel):
    """The on-policy loop: reward, policy step, schedule and iterations."""

    model_config = SECTION

    reward: str | None = Field(
        None,
        description="Reward function, 'module:function' or 'file.py:function'. Set: after "
        "each iteration the rollouts are scored, the reference policy takes a GRPO step and "
        "its weights are synced into the engines before the next iteration. Empty: plain "
        "rollouts.",
        examples=["training.letter_task:reward"],
    )
    reward_style: Literal["batch", "openrlhf", "verl"] = Field(
        "batch",
        description="How the reward is called: 'batch' fn(list[RewardInput]) -> list[float]; "
        "'openrlhf' reward_func(queries, prompts, labels); 'verl' compute_score(data_source, "
        "solution_str, ground_truth, extra_info) per sample.",
    )
    reward_timeout_s: float = Field(
        300.0, gt=0.0, le=86_400.0, description="Deadline for scoring one shard (in Ray)."
    )
    train: bool = Field(
        True,
        description="With a reward: the policy trains on the scored rollouts and its weights "
        "are synced into the engines after each iteration. False: the rollouts are only "
        "scored (an evaluation run; no policy is started).",
    )
    learning_rate: float = Field(1e-5, gt=0.0, le=1.0, description="The policy's step size.")
    micro_batch_tokens: int = Field(
        4096,
        ge=1,
        le=10_000_000,
        description="Padded tokens per forward and backward of a policy step (verl's "
        "ppo_max_token_len_per_gpu); the step's gradient is accumulated over micro-batches, "
        "so its memory does not grow with n or the batch.",
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="What the policy's step computes in: 'bfloat16' under torch.autocast "
        "(as verl's FSDP actor by default), its weights, gradients and optimizer still "
        "float32; 'float32' with TF32 matmuls on a GPU.",
    )
    colocate: bool = Field(
        False,
        description="On-policy runs: the policy shares one GPU with the engines and their "
        "spares (each takes gpu_memory_utilization of it; tensor_parallel_size 1), its "
        "weights synced through CUDA IPC, as verl's hybrid engine: on-policy RL on a single "
        "GPU. Off: the policy takes a GPU of its own and syncs over NCCL.",
    )
    schedule: Schedule = Field(
        "sync",
        description="How generation, training and weight sync interleave. 'sync': one after "
        "the other (strictly on-policy). 'overlap': the engines generate iteration i+1 while "
        "the policy trains on i; the sync runs when both are done. 'in_flight': up to "
        "max_staleness + 1 generations run at once, and new weights are pushed as soon as "
        "the policy has them, into running requests (a row records every version it was "
        "generated under). 'partial': as 'sync', but a step takes the first groups to "
        "complete; the rest are aborted at the sync and resumed under the new weights.",
    )
    # The one declaration of the bound: the schedule and the policy get
    # `staleness_bound`, derived from it (0 under 'sync').
    max_staleness: int = Field(
        1,
        ge=0,
        le=1000,
        description="overlap / in_flight: versions a row may lag the policy that trains on "
        "it (at least 1); partial: iterations a group may wait for its batch (then the "
        "iteration waits for it). 'sync' is strictly on-policy (0).",
    )
    partial_in_flight: float = Field(
        1.5,
        ge=1.0,
        le=2.0,
        description="partial: groups kept generating, as a multiple of the batch (the "
        "prompts file's rows; at most 2, so the groups at their wait bound fit in one "
        "batch); a step takes the first batch of them to complete.",
    )
    partial_keep_generating: bool = Field(
        True,
        description="partial: the groups a step does not take go on generating while the "
        "policy trains (on the version that started them), and are aborted at the sync, so "
        "the engines do not wait for the step. Off: they are aborted when the batch is "
        "complete, and a colocated policy has the GPU to itself.",
    )
    partial_start_next: bool = Field(
        False,
        description="partial, with partial_keep_generating: while the policy trains, the "
        "next iteration's groups start in the places of the held groups' samples that are "
        "done, on the version served, so the engines keep busy through the step. Their "
        "oldest tokens are then one version older (a group is due by its oldest token).",
    )
    weight_sync_probe: bool = Field(
        True,
        description="After each weight sync, every engine compares its logprobs of a fixed "
        "16-token prompt with the policy's before it releases anything computed on the new "
        "weights (the probe rides with its first batch); a mismatch marks it stale and its "
        "held requests are requeued. Costs one short forward pass per engine and one on the "
        "policy.",
    )
    iterations: int = Field(
        1,
        ge=1,
        le=100_000,
        description="Rounds of generate (-> train -> weight sync). 1: a plain rollout job.",
    )
    # Off by default, as verl's and OpenRLHF's filter_groups: refills cost
    # generation (up to 1 + max_refill_rounds times an iteration's), and a
    # step's work then differs from the schedules' benchmarks without it.
    dynamic_sampling: bool = Field(
        False,
        description="On-policy runs (DAPO's filter_groups): groups whose rewards all agree "
        "are left out of the policy step (their rows are written, marked filtered) and "
        "their prompts sampled again, with new seeds, until every group has signal or "
        "max_refill_rounds is reached.",
    )
    max_refill_rounds: int = Field(
        3,
        ge=0,
        le=100,
        description="dynamic_sampling: the most refill rounds per iteration (DAPO's "
        "max_num_gen_batches - 1); past it the step trains on the groups it has.",
    )

    @model_validator(mode="after")
    def _staleness(self) -> TrainingParams:
        self.schedule_rule.bound(self.max_staleness)
        return self

    @property
    def schedule_rule(self) -> ScheduleRule:
        """What the run's schedule decides (flows/schedule.py)."""
        return SCHEDULES[self.schedule]

    @property
    def staleness_bound(self) -> int:
        """Versions a row may lag the policy: 0 for 'sync'."""
        return self.schedule_rule.bound(self.max_staleness)


class AgentsParams(BaseModel):
    """Agent runs: each of a prompt's n samples is an agent session (agents/),
    and the agent gives the reward."""

    model_config = SECTION

    agent: str | None = Field(
        None,
        description="Agent function, 'module:function' or 'file.py:function': async "
        "agent(client: openai.AsyncOpenAI, row: dict) -> AgentResult (or (reward, info)). "
        "Each of a prompt's n samples is a session of its own on the run's router (the "
        "engines serve the OpenAI API); a request setting no max_tokens or temperature gets "
        "the run's. Its reward replaces --reward.",
        examples=["agents.tool_task:agent"],
    )
    agent_func_path: str | None = Field(
        None,
        description="OpenRLHF's agent file (AgentInstanceBase with reset/step), run as "
        "OpenRLHF runs it; its reward replaces --reward.",
    )
    agent_timeout_s: float = Field(
        120.0, gt=0.0, le=86_400.0, description="Deadline of one agent session."
    )

    @property
    def agentic(self) -> bool:
        """Samples are agent sessions (the agent gives the reward)."""
        return bool(self.agent or self.agent_func_path)
