"""The rollout flow's parameters: one pydantic model.

Prefect renders it as the run form in the UI and, with
`enforce_parameter_schema: true`, the server rejects a deployment run whose
values break its bounds. Checks that JSON Schema cannot express (one field
against another) run again in the flow, before anything is created.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engines.sampling import SamplingParams
from flows.schedule import Schedule


class RolloutParams(BaseModel):
    """Everything one rollout run needs. The defaults run the embedded demo:
    local Ray, the tiny model, the prompts file shipped in the repository."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- input ---------------------------------------------------------------
    prompts_path: str = Field(
        "data/prompts.jsonl",
        min_length=1,
        description="Prompts: a JSONL file (one JSON object per line), a Parquet file, or a "
        "directory of Parquet files. Relative paths are taken from the working directory.",
    )
    prompt_field: str = Field(
        "prompt",
        min_length=1,
        description="Field (JSONL) or column (Parquet) holding the prompt: a string, or a "
        "list of chat messages ({role, content}; needs apply_chat_template).",
    )
    label_field: str | None = Field(
        None,
        min_length=1,
        description="Field holding the label (ground truth) the reward gets; dotted for a "
        "nested one, e.g. 'reward_model.ground_truth'. Empty: no label.",
    )
    id_field: str | None = Field(
        None,
        min_length=1,
        description="Field holding each row's id (unique). Empty: the row's position.",
    )
    apply_chat_template: bool = Field(
        False,
        description="Render prompts with the model tokenizer's chat template (a text prompt "
        "becomes one user message), with the generation prompt appended.",
    )

    # --- engines -------------------------------------------------------------
    model: str | None = Field(
        None,
        description="Model directory (HF layout) or hub id. Empty: the tiny test model, "
        "built locally on first use.",
    )
    backend: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="'auto': vLLM when the cluster has GPUs and vLLM is installed, else hf."
    )
    num_engines: int = Field(2, ge=1, le=256, description="Rollout engines (Ray actors).")
    tensor_parallel_size: int = Field(1, ge=1, le=16, description="GPUs (bundles) per engine.")
    max_len: int = Field(512, ge=2, le=1_048_576, description="Prompt plus response tokens.")
    gpu_memory_utilization: float = Field(
        0.85, gt=0.0, le=1.0, description="Fraction of each GPU an engine may use (vLLM)."
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description='Further vLLM engine arguments, e.g. {"enforce_eager": true}.',
    )

    # --- sampling ------------------------------------------------------------
    n: int = Field(1, ge=1, le=1024, title="Samples per prompt")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k.")
    max_tokens: int = Field(64, ge=1, description="Response tokens at most.")
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence.")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="Write per-token logprobs: 0 the sampled token, k also the top k. Empty: none.",
    )
    stop: list[str] = Field(
        default_factory=list,
        description='Stop strings (a string, or a JSON list: ["\\n", "###"]).',
    )
    stop_token_ids: list[int] = Field(default_factory=list, description="Stop token ids.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string.")
    min_tokens: int = Field(0, ge=0, description="Response tokens at least before EOS/stop.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the top one.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="1 disables it.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    seed: int = Field(
        42,
        ge=0,
        le=2**62,
        description="Base seed. A request's seed is derived from it, the iteration and the "
        "prompt's index, so a rollout does not depend on which engine served it.",
    )

    # --- training (the on-policy loop) -------------------------------------------
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
        "generated under).",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        le=1000,
        description="overlap / in_flight: versions a row may lag the policy that trains on "
        "it (at least 1). 'sync' is strictly on-policy (0).",
    )

    # --- loop and output -----------------------------------------------------
    iterations: int = Field(
        1,
        ge=1,
        le=100_000,
        description="Rounds of generate (-> train -> weight sync). 1: a plain rollout job.",
    )
    shard_size: int = Field(
        16, ge=1, le=1_000_000, description="Prompts per output shard; a rerun skips finished ones."
    )
    output_dir: str = Field(
        "out", min_length=1, description="Each run writes under <output_dir>/<flow run id>/."
    )
    output_format: Literal["parquet", "jsonl"] = Field(
        "parquet", description="Format of the shards (one per run)."
    )
    logger: Literal["none", "tensorboard", "wandb"] = Field(
        "none",
        description="Where the per-iteration metrics also go: TensorBoard event files under "
        "the run directory (offline), or Weights & Biases (needs the wandb package).",
    )

    # --- cluster and failure handling ------------------------------------------
    address: str | None = Field(
        None,
        description="Ray cluster to connect to. Empty: RAY_ADDRESS if set, else a local Ray "
        "started for the run.",
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra Ray runtime_env for the run's job, merged with the project's code "
        'that the run ships to a cluster, e.g. {"env_vars": {"HF_HOME": "/data/hf"}}.',
    )
    local_num_cpus: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Logical CPUs of a local Ray. Empty: enough for the engines.",
    )
    spare_engines: int = Field(
        0,
        ge=0,
        le=64,
        description="Warm spares: engines started with the others, on bundles reserved for "
        "them, then put to sleep. A spare takes a dead engine's place in seconds (woken and "
        "synced to the current weights first) instead of a cold start.",
    )
    engine_retries: int = Field(
        2,
        ge=0,
        le=20,
        description="Retries of readiness and generation after an engine dies or hangs; "
        "the engine is replaced first. Other errors are not retried.",
    )
    ready_timeout_s: float = Field(
        600.0, gt=0.0, le=86_400.0, description="Deadline for all engines to come up."
    )
    request_timeout_s: float = Field(
        300.0,
        gt=0.0,
        le=86_400.0,
        description="Deadline for one shard on one engine; past it the engine counts as hung.",
    )
    shards_per_engine: int = Field(
        2,
        ge=1,
        le=64,
        description="Shards in flight per engine. Engines pull the next shard as they finish "
        "one, so a slow engine does not hold the others back.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _fits(self) -> RolloutParams:
        if self.max_tokens >= self.max_len:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must be below max_len ({self.max_len}): "
                "the prompt needs room too"
            )
        if self.schedule == "sync":
            if "max_staleness" in self.model_fields_set and self.max_staleness != 0:
                raise ValueError(
                    f"max_staleness ({self.max_staleness}) needs schedule 'overlap' or "
                    "'in_flight': 'sync' is strictly on-policy"
                )
        elif self.max_staleness < 1:
            raise ValueError(
                f"schedule {self.schedule!r} needs max_staleness >= 1, got {self.max_staleness}"
            )
        if self.colocate and not self.on_policy:
            raise ValueError(
                "colocate puts the policy beside the engines: it needs an on-policy run "
                "(a reward, and train on)"
            )
        if self.colocate and self.tensor_parallel_size != 1:
            raise ValueError(
                f"colocate puts every engine on one GPU: tensor_parallel_size must be 1, got "
                f"{self.tensor_parallel_size}"
            )
        return self

    @property
    def on_policy(self) -> bool:
        """A policy trains on the rollouts (and its weights go to the engines)."""
        return bool(self.reward) and self.train

    @property
    def staleness_bound(self) -> int:
        """Versions a row may lag the policy: 0 for 'sync'."""
        return 0 if self.schedule == "sync" else self.max_staleness

    def sampling(self) -> SamplingParams:
        """Sampling parameters shared by every request (each gets its own seed).
        The vLLM-named fields go through when set: `SamplingParams` refuses one
        its backend cannot honour, naming it, rather than dropping it."""
        values = {name: getattr(self, name) for name in ALWAYS_SAMPLED}
        values.update(
            {
                name: getattr(self, name)
                for name in SAMPLED_WHEN_SET
                if name in self.model_fields_set
            }
        )
        return SamplingParams(**values)


ALWAYS_SAMPLED = ("n", "temperature", "top_p", "top_k", "max_tokens", "ignore_eos", "logprobs")
#: vLLM's per-request fields; at their defaults they mean what vLLM's defaults mean.
SAMPLED_WHEN_SET = (
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "min_tokens",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "skip_special_tokens",
)
