"""The rollout flow's parameters: one pydantic model.

Prefect renders it as the run form in the UI and, with
`enforce_parameter_schema: true`, the server rejects a deployment run whose
values break its bounds. Checks that JSON Schema cannot express (one field
against another) run again in the flow, before anything is created.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engines.sampling import SamplingParams


class RolloutParams(BaseModel):
    """Everything one rollout run needs. The defaults run the embedded demo:
    local Ray, the tiny model, the prompts file shipped in the repository."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- input ---------------------------------------------------------------
    prompts_path: str = Field(
        "data/prompts.jsonl",
        min_length=1,
        description="Prompts file: JSONL (one JSON object per line) or Parquet (.parquet). "
        "Relative paths are taken from the working directory.",
    )
    prompt_field: str = Field(
        "prompt", min_length=1, description="Field (JSONL) or column (Parquet) holding the prompt."
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
        description="Reward function, 'module:function'. Set: after each iteration the "
        "reference policy scores the rollouts, takes a GRPO step and its weights are synced "
        "into the engines before the next iteration. Empty: plain rollouts.",
        examples=["training.rewards:target_chars_fraction"],
    )
    learning_rate: float = Field(1e-5, gt=0.0, le=1.0, description="The policy's step size.")

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
    output_format: Literal["jsonl", "parquet", "both"] = Field("jsonl")

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

    @model_validator(mode="after")
    def _fits(self) -> RolloutParams:
        if self.max_tokens >= self.max_len:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must be below max_len ({self.max_len}): "
                "the prompt needs room too"
            )
        return self

    def sampling(self) -> SamplingParams:
        """Sampling parameters shared by every request (each gets its own seed)."""
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
        )
