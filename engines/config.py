"""The configuration one engine actor is built from (plain data, crosses Ray)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Ray actor name, `<prefix>-<index>`.")
    pretrain: str = Field(description="Local model directory (HF layout) or hub id.")
    max_len: int = Field(ge=2, description="Prompt plus generated tokens, at most.")
    seed: int
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="None: vLLM's default."
    )
    tensor_parallel_size: int = Field(1, ge=1)
    enable_prefix_caching: bool = False
    bundle_indices: list[int] = Field(default_factory=list)
    rpc_timeout_s: float = Field(gt=0.0, description="Deadline of calls into the workers.")
    full_determinism: bool = Field(False, description="OpenRLHF's flag (vLLM backend).")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Backend engine arguments (vLLM's EngineArgs names)."
    )
