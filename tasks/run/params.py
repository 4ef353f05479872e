"""The sections of a run's parameters that the tasks take (the flow's
`RolloutParams` in flows/params.py composes them with its own): the prompts
file, the engine set, the output and the cluster. Frozen pydantic models:
the run form's fields, with their bounds.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SECTION = ConfigDict(extra="forbid", frozen=True)


class DataParams(BaseModel):
    """The prompts file and which of its columns are what."""

    model_config = SECTION

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


class EngineParams(BaseModel):
    """The engine set. Names as the engine-set spec's, so every field passes
    on by name (`tasks.engines.engine_spec`)."""

    model_config = SECTION

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
    quantization: Literal["fp8"] | None = Field(
        None,
        description="'fp8': FP8 rollouts from a bf16 model and trainer (vLLM quantizes the "
        "weights online at start-up and after every weight sync). Empty: as the checkpoint.",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description='Further vLLM engine arguments, e.g. {"enforce_eager": true}.',
    )
    spare_engines: int = Field(
        0,
        ge=0,
        le=64,
        description="Warm spares: engines started with the others, on bundles reserved for "
        "them, then put to sleep. A spare takes a dead engine's place in seconds (woken and "
        "synced to the current weights first) instead of a cold start.",
    )
    prepared_actors: int = Field(
        0,
        ge=0,
        le=64,
        description="Engine actors started with the others with their imports done and no "
        "engine or GPU: one takes the place of an engine whose actor is lost, so the "
        "replacement pays the engine's own start only. tensor_parallel_size 1.",
    )
    openai_api: bool = Field(
        False,
        description="Each engine serves the OpenAI API (chat, completions, tokenize) on its "
        "node's address and a free port, behind a bearer token drawn for the run; the "
        "engine table shows each URL.",
    )
    tool_call_parser: str | None = Field(
        None, description="Parses tool calls out of chat answers (vLLM's names: 'hermes')."
    )


class OutputParams(BaseModel):
    """Where and how the rows are written, and where the metrics also go."""

    model_config = SECTION

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


class ClusterParams(BaseModel):
    """The Ray cluster, and how the run waits on and retries its engines."""

    model_config = SECTION

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
        8,
        ge=1,
        le=64,
        description="The most shards in flight per engine. Below it each engine's share "
        "follows its load: more while no request waits in its queue and its KV cache has "
        "room, less when requests wait or its shards slow down. Engines pull the next shard "
        "as they finish one, so a slow engine does not hold the others back.",
    )
