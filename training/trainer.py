"""The trainer interface: what the flow needs from any trainer. Plug your own
in by subclassing `Trainer` (and running it as a Ray actor).

Lifecycle, as for the engines' weight transfer: init (constructor: load the
model) -> start (`init_weight_sync(engines)`) -> update (`train_step` and
`sync_weights`, per iteration) -> finish (`close`). Weight sync is provided
here on top of `named_weights()`, through the sender of the transport named
(`engines.weight_sync.factory.transport_for` picks it from placement).
"""

from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from engines.weight_sync import LoraSync, SyncConfig, SyncReport
from engines.weight_sync.coordinator import as_engine_list
from engines.weight_sync.factory import new_sender
from engines.weight_sync.probe import ProbeReference
from engines.weight_sync.protocol import SenderOptions, WeightSender
from engines.weight_sync.transports import checkpoint as ckpt

logger = logging.getLogger(__name__)


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
    #: Their tokens, prompt and completion: what the step's forward and
    #: backward passes ran over.
    trained_tokens: int
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
        """Connect to the engines through `transport`'s sender (for
        "broadcast": build the process group)."""
        options = SenderOptions(
            SyncConfig(**(sync_config or {})),
            weights_device=self.device_of_weights,
            backend=backend,
            checkpoint_dir=checkpoint_dir,
            lora=self.lora_sync(),
        )
        sender = new_sender(transport, options)
        self.close()
        self._init_kwargs = dict(
            transport=transport,
            backend=backend,
            sync_config=sync_config,
            checkpoint_dir=checkpoint_dir,
        )
        self._synced_version = None
        self._engines = as_engine_list(engines)
        self._sender = sender
        sender.init(self._engines)
        return {"transport": transport, "engines": len(self._engines), **sender.summary()}

    def lora_sync(self) -> LoraSync | None:
        """A trainer of a LoRA adapter: the adapter's shape and how many
        versions the engines keep (then `named_weights()` is the adapter's
        tensors, peft's names, and a sync sends those only)."""
        return None

    def probe_reference(self) -> ProbeReference | None:
        """The trainer's logprobs of the sync's probe prompt on the weights it
        sends (`engines.weight_sync.probe.reference`), which each engine
        checks before it serves them; None: this trainer cannot compute them
        (the report then says the probe was skipped)."""
        return None

    def device_of_weights(self) -> Any:
        return self.named_weights()[0][1].device

    def sync_weights(
        self, engines: list[Any] | None = None, *, reconnect: bool = False
    ) -> SyncReport:
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
            return SyncReport(version, self._sender.transport, len(self._engines), skipped=True)
        started = time.monotonic()
        probe = self.probe_reference() if self._sender.config.probe else None
        referenced = time.monotonic() - started
        report = self._sender.sync(self.named_weights(), version, probe)
        if probe is not None:
            report = replace(report, phases={"probe_reference": referenced, **report.phases})
        self._synced_version = version
        logger.info(
            "synced weight version %d: %d bytes in %.3fs (%.3f GB/s)",
            version,
            report.bytes,
            report.seconds,
            report.gb_per_s,
        )
        return report

    def save_checkpoint(self, path: str) -> str:
        """Write the weights as a safetensors checkpoint (HF layout)."""
        return str(ckpt.save(self.named_weights(), path, version=self.weight_version))

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
