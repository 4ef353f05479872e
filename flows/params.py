"""The rollout flow's parameters: one pydantic model of sections (data,
engines, sampling, training, agents, output, cluster). The sections the
tasks take as they are live in tasks/run/params.py, the sampling section
(derived from the engines' `SamplingParams`) in flows/sampling.py, the
flow's own (training, agents) in flows/sections.py; here the run, and the
one table of flag pairs (`FLAG_PAIRS`): a flag refused beside another
setting that would leave it ignored or meaningless.

Prefect renders it as the run form in the UI and, with
`enforce_parameter_schema: true`, the server rejects a deployment run whose
values break its bounds. Checks that JSON Schema cannot express (one field
against another) run again in the flow, before anything is created.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from flows.sampling import SAMPLED_WHEN_SET, SamplingSection
from flows.schedule import SCHEDULES
from flows.sections import AgentsParams, TrainingParams
from tasks.run.params import ClusterParams, DataParams, EngineParams, OutputParams


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
    def _fits(self) -> RolloutParams:
        if self.sampling.max_tokens >= self.engines.max_len:
            raise ValueError(
                f"max_tokens ({self.sampling.max_tokens}) must be below max_len "
                f"({self.engines.max_len}): the prompt needs room too"
            )
        if clashes := [pair.message(self) for pair in FLAG_PAIRS if pair.refuses(self)]:
            raise ValueError("\n".join(clashes))
        return self

    def value(self, name: str) -> Any:
        """Field `name`'s value, by its name alone (names are unique across sections)."""
        return getattr(getattr(self, FIELD_SECTION[name]), name)


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


def flag(name: str) -> str:
    """Field `name`'s flag (the CLI's; a config file's key is the name)."""
    return "--" + name.replace("_", "-")


def default_of(name: str) -> Any:
    section = RolloutParams.model_fields[FIELD_SECTION[name]].annotation
    return section.model_fields[name].get_default(call_default_factory=True)


def differs(name: str) -> Callable[[RolloutParams], bool]:
    """Whether field `name` is given: a value other than its default (a run
    form or a config file that spells out every default gives nothing)."""
    return lambda run: run.value(name) != default_of(name)


@dataclass(frozen=True)
class FlagPair:
    """A flag refused beside another setting, where the run would ignore it
    or it would mean nothing: refused before anything starts, naming both."""

    name: str
    #: The other flag, and why: "does not work with --schedule partial: ...".
    clash: str
    #: The other setting holds (of the whole run).
    when: Callable[[RolloutParams], bool]
    #: This flag is given; None: its value differs from its default.
    given: Callable[[RolloutParams], bool] | None = None

    def refuses(self, run: RolloutParams) -> bool:
        return (self.given or differs(self.name))(run) and self.when(run)

    def message(self, run: RolloutParams) -> str:
        value = run.value(self.name)
        if isinstance(value, bool):
            typed = flag(self.name) if value else flag("no_" + self.name)
        else:
            typed = f"{flag(self.name)} {value}"
        return f"{typed} {self.clash}"


def partial(run: RolloutParams) -> bool:
    return run.training.schedule_rule.partial


def no_policy(run: RolloutParams) -> bool:
    return not run.on_policy


def no_reward(run: RolloutParams) -> bool:
    return not run.training.reward


NEEDS_POLICY = "needs a policy to train: --reward, --agent or --agent-func-path, without --no-train"
BOTH_REWARD = "both give the reward: set one of --reward, --agent, --agent-func-path"
STALE = " or ".join(name for name, rule in SCHEDULES.items() if rule.stale)
NOT_IN_PARTIAL = "does not work with --schedule partial:"
ONLY_PARTIAL = "needs --schedule partial: only partial rollouts keep groups past their batch"
#: What an `--agent` run's sessions do not take from the run: an agent's
#: requests carry their own sampling, the run's is the default of
#: --max-tokens and --temperature only (agents/router/proxy.py).
AGENT_UNSAMPLED = ("top_p", "top_k", "ignore_eos", "logprobs", *SAMPLED_WHEN_SET)

#: Every flag refused beside another setting (docs/flow.md lists them; each
#: pair has its test in tests/flows/test_params.py).
FLAG_PAIRS: tuple[FlagPair, ...] = (
    FlagPair(
        "agent", f"does not work with --reward: {BOTH_REWARD}", lambda r: bool(r.training.reward)
    ),
    FlagPair(
        "agent_func_path",
        f"does not work with --reward: {BOTH_REWARD}",
        lambda r: bool(r.training.reward),
    ),
    FlagPair(
        "agent_func_path",
        f"does not work with --agent: {BOTH_REWARD}",
        lambda r: bool(r.agents.agent),
    ),
    *(
        FlagPair(name, NEEDS_POLICY, no_policy)
        for name in (
            "colocate",
            "schedule",
            "dynamic_sampling",
            "learning_rate",
            "micro_batch_tokens",
            "compute_dtype",
            "weight_sync_probe",
        )
    ),
    FlagPair(
        "train",
        "needs --reward, --agent or --agent-func-path: a run without a reward trains nothing",
        lambda r: not (r.training.reward or r.agents.agentic),
    ),
    FlagPair(
        "colocate",
        "needs --tensor-parallel-size 1: colocate puts every engine on one GPU",
        lambda r: r.engines.tensor_parallel_size != 1,
    ),
    FlagPair(
        "dynamic_sampling",
        "needs --n 2 or more: a group of one sample has no rewards to compare",
        lambda r: r.sampling.n < 2,
    ),
    FlagPair(
        "dynamic_sampling",
        f"{NOT_IN_PARTIAL} the partial schedule's generation neither filters groups nor "
        "refills them",
        partial,
    ),
    FlagPair(
        "max_refill_rounds",
        "needs --dynamic-sampling: only dynamic sampling refills",
        lambda r: not r.training.dynamic_sampling,
    ),
    # Set and not 0 (its default is the stale schedules' bound).
    FlagPair(
        "max_staleness",
        f"needs --schedule {STALE}: 'sync' is strictly on-policy",
        lambda r: not r.training.schedule_rule.stale,
        given=lambda r: (
            "max_staleness" in r.training.model_fields_set and r.training.max_staleness > 0
        ),
    ),
    FlagPair("partial_in_flight", ONLY_PARTIAL, lambda r: not partial(r)),
    FlagPair("partial_keep_generating", ONLY_PARTIAL, lambda r: not partial(r)),
    FlagPair("partial_start_next", ONLY_PARTIAL, lambda r: not partial(r)),
    FlagPair(
        "partial_start_next",
        "needs --partial-keep-generating: the next groups start in the places of those "
        "left generating beside the policy step",
        lambda r: not r.training.partial_keep_generating,
    ),
    FlagPair("agent", f"{NOT_IN_PARTIAL} its generation runs no agent sessions", partial),
    FlagPair("agent_func_path", f"{NOT_IN_PARTIAL} its generation runs no agent sessions", partial),
    FlagPair("shard_size", f"{NOT_IN_PARTIAL} an iteration writes its batch as one shard", partial),
    FlagPair(
        "shards_per_engine",
        f"{NOT_IN_PARTIAL} its samples go to the engines in segments, not shards",
        partial,
    ),
    FlagPair(
        "reward_style", "needs --reward: it says how the reward function is called", no_reward
    ),
    FlagPair(
        "reward_timeout_s",
        "needs --reward: it is the reward function's deadline (an agent gives its own reward)",
        no_reward,
    ),
    FlagPair(
        "agent_timeout_s",
        "needs --agent or --agent-func-path: it is an agent session's deadline",
        lambda r: not r.agents.agentic,
    ),
    *(
        FlagPair(
            name,
            "does not work with --agent: an agent's requests carry their own sampling, the "
            "run's sessions get --max-tokens and --temperature only (--agent-func-path "
            "takes every sampling flag)",
            lambda r: bool(r.agents.agent),
        )
        for name in AGENT_UNSAMPLED
    ),
    FlagPair(
        "tool_call_parser",
        "needs --openai-api or --agent: it parses the tool calls of the OpenAI endpoint's "
        "chat answers",
        lambda r: not (r.engines.openai_api or r.agents.agent),
    ),
    FlagPair(
        "local_num_cpus",
        "does not work with --address: it sizes a local Ray, a cluster has its own CPUs",
        lambda r: bool(r.cluster.address),
    ),
)
