"""The rollout flow's parameters: one pydantic model of sections (data,
engines, sampling, training, agents, output, cluster). The sections the
tasks take as they are live in tasks/run/params.py, the sampling section
(derived from the engines' `SamplingParams`) in flows/sampling.py; the
flow's own (training, agents) here.

Prefect renders it as the run form in the UI and, with
`enforce_parameter_schema: true`, the server rejects a deployment run whose
values break its bounds. Checks that JSON Schema cannot express (one field
against another) run again in the flow, before anything is created.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flows.sampling import SamplingSection
from flows.schedule import SCHEDULES, Schedule, ScheduleRule
from tasks.run.params import SECTION, ClusterParams, DataParams, EngineParams, OutputParams


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
        rule = self.schedule_rule
        if not rule.stale and "max_staleness" in self.model_fields_set and self.max_staleness:
            stale = " or ".join(repr(name) for name, r in SCHEDULES.items() if r.stale)
            raise ValueError(
                f"max_staleness ({self.max_staleness}) needs schedule {stale}: "
                f"{self.schedule!r} is strictly on-policy"
            )
        rule.bound(self.max_staleness)
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


class RolloutParams(BaseModel):
    """Everything one rollout run needs, in sections. The defaults run a
    plain job: local Ray, the tiny model, the prompts file shipped in the
    repository."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: DataParams = DataParams()
    engines: EngineParams = EngineParams()
    sampling: SamplingSection = SamplingSection()
    training: TrainingParams = TrainingParams()
    agents: AgentsParams = AgentsParams()
    output: OutputParams = OutputParams()
    cluster: ClusterParams = ClusterParams()

    @model_validator(mode="before")
    @classmethod
    def _sectioned(cls, values: Any) -> Any:
        """Parameters of the flat shape the run took before it had sections
        (a config file, a deployment's parameters) name each field's place."""
        if isinstance(values, dict) and (flat := [k for k in values if k in FIELD_SECTION]):
            moved = ", ".join(f"{name} -> {FIELD_SECTION[name]}.{name}" for name in flat)
            raise ValueError(f"parameters are in sections now: {moved}")
        return values

    @property
    def on_policy(self) -> bool:
        """A policy trains on the rollouts (and its weights go to the engines)."""
        return bool(self.training.reward or self.agents.agentic) and self.training.train

    @model_validator(mode="after")
    def _one_reward(self) -> RolloutParams:
        agents = self.agents
        named = {
            "reward": self.training.reward,
            "agent": agents.agent,
            "agent_func_path": agents.agent_func_path,
        }
        given = [name for name, value in named.items() if value]
        if len(given) > 1:
            raise ValueError(
                f"{' and '.join(given)} both give the reward: set one of reward, agent, "
                "agent_func_path"
            )
        return self

    @model_validator(mode="after")
    def _fits(self) -> RolloutParams:
        if self.sampling.max_tokens >= self.engines.max_len:
            raise ValueError(
                f"max_tokens ({self.sampling.max_tokens}) must be below max_len "
                f"({self.engines.max_len}): the prompt needs room too"
            )
        if self.training.colocate and not self.on_policy:
            raise ValueError(
                "colocate puts the policy beside the engines: it needs an on-policy run "
                "(a reward, and train on)"
            )
        if self.training.dynamic_sampling and not (self.on_policy and self.sampling.n >= 2):
            raise ValueError(
                "dynamic_sampling filters groups by their rewards: it needs an on-policy run "
                f"(a reward, and train on) and n >= 2 samples per prompt, got n={self.sampling.n}"
            )
        if self.training.colocate and self.engines.tensor_parallel_size != 1:
            raise ValueError(
                f"colocate puts every engine on one GPU: tensor_parallel_size must be 1, got "
                f"{self.engines.tensor_parallel_size}"
            )
        return self


#: Each field's section, by the field's name (names are unique across sections).
FIELD_SECTION: dict[str, str] = {
    name: section
    for section, info in RolloutParams.model_fields.items()
    for name in info.annotation.model_fields
}


def sectioned(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Values keyed by field name (the CLI's flags), put in their sections."""
    sections: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        sections.setdefault(FIELD_SECTION[name], {})[name] = value
    return sections
