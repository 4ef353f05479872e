"""A worker's weights as a trainer must send them (`WorkerManifest`, the base
of `worker.WorkerWeights`): the layout it accepts, in HF names, and the
differences between a trainer's manifest and it.

A transformers model's layout is its own parameters; a vLLM model's are
fused and sharded, so its layout is read from the checkpoint the engine loaded.
"""

from __future__ import annotations

import os
from typing import Any

from engines.weight_sync.formats import moe
from engines.weight_sync.formats.hf_checkpoint import read_manifest
from engines.weight_sync.formats.manifest import (
    Manifest,
    ParamSpec,
    dtype_name,
    mismatches,
    torch_dtype,
)


class WorkerManifest:
    """The model a worker holds and the manifest it accepts; `host` has
    `_model()`, `device`, `rank`, `model_config`."""

    def __init__(self, host: Any):
        self.host = host
        self.expected: Manifest | None = None

    @property
    def device(self) -> Any:
        return self.host.device

    def model(self) -> Any:
        return self.host._model()

    def is_vllm_model(self) -> bool:
        # vLLM models load HF-named weights through `load_weights` (fusing, TP shards).
        return hasattr(self.model(), "load_weights")

    def expected_manifest(self) -> Manifest:
        if self.expected is None:
            if self.is_vllm_model():
                self.expected = self._checkpoint_manifest()
            else:
                self.expected = Manifest.of(self.model().named_parameters())
        return self.expected

    def _checkpoint_manifest(self) -> Manifest:
        """vLLM's parameters are fused and sharded, so the HF layout a trainer
        sends is read from the checkpoint the engine loaded; floating-point
        weights arrive in the serving dtype."""
        config = self.host.model_config
        path = config.model
        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download

            path = snapshot_download(
                path,
                revision=config.revision,
                local_files_only=True,
                allow_patterns=["*.safetensors", "*.json"],
            )
        serving = dtype_name(config.dtype)
        params = [
            p.model_copy(update={"dtype": serving}) if torch_dtype(p.dtype).is_floating_point else p
            for p in read_manifest(path).params
        ]
        return Manifest(params=tuple(params))

    def weight_manifest(self) -> dict:
        """The layout this worker accepts (HF names), as plain data."""
        return self.expected_manifest().model_dump(mode="json")

    def weight_manifest_problems(self, manifest: dict, allow_partial: bool = False) -> list[str]:
        """Differences between the trainer's manifest and this worker's, one line each."""
        got = Manifest.model_validate(manifest)
        expected = self.expected_manifest()
        if not self.is_vllm_model():
            return mismatches(expected, got, allow_partial=allow_partial)
        # A checkpoint may hold weights vLLM does not load (tied lm_head, rotary
        # buffers): only the names sent are checked, fused MoE experts per expert.
        seen = moe.in_engine_layout(got, set(expected.names))
        return mismatches(expected, seen, allow_partial=True)

    def problems_of(self, specs: list[ParamSpec]) -> list[str]:
        return self.weight_manifest_problems(
            Manifest(params=tuple(specs)).model_dump(mode="json"), allow_partial=True
        )
