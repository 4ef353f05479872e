"""The trainer interface: what the flow needs from any trainer. Plug your own
in by subclassing `Trainer` (and running it as a Ray actor).

Lifecycle, as for the engines' weight transfer: init (constructor: load the
model) -> start (`init_weight_sync(engines)`) -> update (`train_step` and
`sync_weights`, per iteration) -> finish (`close`). Weight sync is provided
here on top of `named_weights()`, with the transport the config picks.
"""

from __future__ import annotations

import abc
import logging
import os
from dataclasses import dataclass
from typing import Any

from engines.weight_sync import (
    BroadcastSender,
    CudaIpcSender,
    SyncConfig,
    sync_from_checkpoint,
)
from engines.weight_sync import checkpoint as ckpt
from engines.weight_sync.coordinator import as_engine_list
from engines.weight_sync.protocol import WeightSender

logger = logging.getLogger(__name__)

TRANSPORTS = ("broadcast", "cuda_ipc", "checkpoint")


@dataclass(frozen=True)
class StepReport:
    """One training step. The off-policy fields are None when no sample
    carried behaviour logprobs (nothing to compare with)."""

    #: The policy's version after the step.
    version: int
    loss: float
    grad_norm: float
    mean_reward: float
    reward_std: float
    samples: int
    #: Samples with a non-zero advantage and a completion (the others carry no signal).
    trained_samples: int
    seconds: float
    #: Staleness of the rows: the policy's version before the step minus the
    #: oldest version each row was generated under.
    staleness_max: int
    staleness_mean: float
    #: Train/inference mismatch per token: mean |proximal - behaviour logprob|,
    #: and the k3 estimate of KL(behaviour || proximal).
    logprob_mismatch: float | None = None
    kl_k3: float | None = None
    #: Truncated importance weights: their mean, and the fraction of tokens cut at the cap.
    is_weight_mean: float | None = None
    is_truncated_fraction: float | None = None


class Trainer(abc.ABC):
    """A trainable policy whose weights the rollout engines follow."""

    #: Version of the trainer's weights: bumped by every optimizer step; a
    #: sync publishes it, engines stamp it on what they generate.
    weight_version: int = 0

    @abc.abstractmethod
    def train_step(self, groups: list[Any]) -> StepReport:
        """One update from scored rollout groups; increments `weight_version`."""

    @abc.abstractmethod
    def named_weights(self) -> list[tuple[str, Any]]:
        """(HF name, tensor) of every weight the engines serve, in a fixed order."""

    # --- weight sync --------------------------------------------------------------
    _sender: WeightSender | None = None
    _engines: list[Any] | None = None
    # The version the engines were last synced to; None: unknown (they loaded
    # the pretrained weights, the same as the trainer's version 0 if the
    # trainer has not stepped, else must be synced).
    _synced_version: int | None = None

    def init_weight_sync(
        self,
        engines: list[Any],
        *,
        transport: str = "broadcast",
        backend: str = "gloo",
        sync_config: dict[str, Any] | None = None,
        checkpoint_dir: str | None = None,
    ) -> dict[str, Any]:
        """Connect to the engines (for "broadcast": build the process group)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "checkpoint" and not checkpoint_dir:
            raise ValueError("transport 'checkpoint' needs checkpoint_dir")
        config = SyncConfig(**(sync_config or {}))
        self.close()
        self._init_kwargs = dict(
            transport=transport,
            backend=backend,
            sync_config=sync_config,
            checkpoint_dir=checkpoint_dir,
        )
        self._synced_version = None
        self._engines = as_engine_list(engines)
        self._transport = transport
        self._sync_config = config
        self._checkpoint_dir = checkpoint_dir
        info: dict[str, Any] = {"transport": transport, "engines": len(self._engines)}
        if transport == "broadcast":
            self._sender = BroadcastSender(config, backend=backend, device=self.device_of_weights())
            group = self._sender.init(self._engines)
            info.update(world_size=group.world_size, backend=group.backend)
        elif transport == "cuda_ipc":
            self._sender = CudaIpcSender(config)
            self._sender.init(self._engines)
        return info

    def device_of_weights(self) -> Any:
        return self.named_weights()[0][1].device

    def sync_weights(
        self, engines: list[Any] | None = None, *, reconnect: bool = False
    ) -> dict[str, Any]:
        """Publish `weight_version` to the engines; a no-op (reported as
        skipped) when they already have it. Pass the current `engines` when
        some may have been replaced: a changed set is reconnected and synced
        in full, and so is the same set with `reconnect` (an engine restarted
        in its actor keeps its handle but lost its weights and connection)."""
        if self._engines is None:
            raise RuntimeError("call init_weight_sync(engines) first")
        changed = engines is not None and list(engines) != list(self._engines)
        if changed or reconnect:
            logger.info("the engine set changed or restarted: reconnecting weight sync")
            self.init_weight_sync(engines or self._engines, **self._init_kwargs)
        version = self.weight_version
        if version == self._synced_version:
            return {
                "version": version,
                "skipped": True,
                "bytes": 0,
                "seconds": 0.0,
                "gb_per_s": 0.0,
            }
        if self._transport == "checkpoint":
            path = os.path.join(self._checkpoint_dir, f"v{version:06d}")
            ckpt.save(self.named_weights(), path, version=version)
            report = sync_from_checkpoint(self._engines, path, version, self._sync_config)
        else:
            report = self._sender.sync(self.named_weights(), version)
        self._synced_version = version
        result = report.as_dict()
        result["skipped"] = False
        logger.info(
            "synced weight version %d: %d bytes in %.3fs (%.3f GB/s)",
            version,
            report.bytes,
            report.seconds,
            report.gb_per_s,
        )
        return result

    def save_checkpoint(self, path: str) -> str:
        """Write the weights as a safetensors checkpoint (HF layout)."""
        return str(ckpt.save(self.named_weights(), path, version=self.weight_version))

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
