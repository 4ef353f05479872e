"""Configuration of the reference policy (checked where it enters: the actor)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pretrain: str = Field(description="Model directory (HF layout) the engines also loaded.")
    seed: int = 0
    learning_rate: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    clip_eps: float = Field(0.2, gt=0.0, description="PPO ratio clip.")
    max_staleness: int = Field(
        0, ge=0, description="Versions a rollout may lag the policy (0: strictly on-policy)."
    )
    tis_cap: float = Field(
        2.0,
        ge=1.0,
        description="Cap of the truncated importance weight pi_policy / pi_behaviour per token.",
    )
    micro_batch_tokens: int = Field(
        4096,
        ge=1,
        description="Padded tokens per forward and backward of a train step (verl's "
        "ppo_max_token_len_per_gpu): the step's gradient is accumulated over micro-batches "
        "of at most this many, so its activations fit whatever the batch.",
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="What the step's forward and backward compute in. 'bfloat16': under "
        "torch.autocast, as verl's FSDP actor computes by default (its mixed_precision's "
        "param_dtype); the weights, their gradients and the optimizer stay float32.",
    )
    torch_threads: int = Field(1, ge=1)
    device: str = "cpu"
    sync_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="dtype of the weights sent to the engines; None: the checkpoint's "
        "dtype, which engines load by default (training itself stays in float32).",
    )
    # LoRA: train an adapter on the frozen base; the sync sends the adapter only
    lora_rank: int | None = Field(
        None, ge=1, description="Train a LoRA adapter of this rank (None: the full model)."
    )
    lora_alpha: float = Field(16.0, gt=0.0)
    lora_target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        min_length=1,
        description="Module names (or their suffixes) that get an adapter, as peft's.",
    )
    # Weight sync
    transport: str = Field(
        "broadcast",
        description="A transport with a trainer side, by its registered name "
        "(`engines.weight_sync.factory.transport_for` picks it from placement).",
    )
    sync_backend: Literal["gloo", "nccl"] = "gloo"
    bucket_bytes: int = Field(1 << 30, ge=1024)
    sync_timeout_s: float = Field(60.0, gt=0.0)
    verify: bool = True
    on_failure: Literal["restore", "stale"] = "stale"
    probe: bool = Field(
        True,
        description="After each sync, every engine compares its logprobs of a fixed short "
        "prompt with the policy's before it releases anything computed on the new weights "
        "(docs/weight_sync.md).",
    )
    checkpoint_dir: str | None = Field(
        None, description="Where the checkpoint transport writes (shared with the engines)."
    )

    @field_validator("transport")
    @classmethod
    def _registered(cls, value: str) -> str:
        # The registry, not a list kept here: a transport is one module.
        from engines.weight_sync.factory import trainer_transports

        if value not in trainer_transports():
            raise ValueError(f"transport must be one of {trainer_transports()}, got {value!r}")
        return value
