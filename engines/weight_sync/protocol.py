"""The weight-sync protocol: what an engine needs from its host actor, what
each step answers (typed), what a sync reports, and what a transport is.

Three places take part in a sync: the trainer (a sender, per transport), the
engine actor (`session.WeightSync`, composed by `RolloutEngine`) and each
worker that holds the model (`worker.WorkerWeights`, behind vLLM's worker
extension or the CPU backend's worker). A transport is one module holding
its trainer side (`new_sender`), its engine-actor methods and its worker
methods; it is registered by naming its module in `factory.TRANSPORTS`
(loaded lazily there: this module imports none of them).

Answers from the engine actor are dataclasses (they cross Ray by pickle).
Answers from a worker cross vLLM's msgpack RPC, which takes plain data only:
`WorkerAnswer.plain()` / `WorkerAnswer.of()` are the one place their keys live.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engines.weight_sync.config import SyncConfig
    from engines.weight_sync.probe import ProbeReference, ProbeResult


@dataclass(frozen=True)
class SyncReport:
    """What one sync did, carried typed from the trainer up to the flow's
    table. `skipped`: the engines already served `version` (nothing moved);
    `iteration`: set by the flow's task, which knows it."""

    version: int
    transport: str
    engines: int
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    verified: bool = False
    phases: dict[str, float] = field(default_factory=dict)
    #: Inside the engines, the slowest engine's seconds per step (pause_s,
    #: prepare_s of begin; wait_s, load_s or open_s, load_s of the transfer):
    #: where a phase's time went.
    engine_times: dict[str, float] = field(default_factory=dict)
    skipped: bool = False
    iteration: int | None = None
    #: The probe after the sync (`probe.py`): passed, skipped or off, its
    #: seconds and differences.
    probe: ProbeResult | None = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain and rounded, for a benchmark's JSON."""
        return {
            "version": self.version,
            "transport": self.transport,
            "engines": self.engines,
            "bytes": self.bytes,
            "buckets": self.buckets,
            "seconds": round(self.seconds, 6),
            "gb_per_s": round(self.gb_per_s, 6),
            "verified": self.verified,
            "phases": {k: round(v, 6) for k, v in self.phases.items()},
            "engine_times": {k: round(v, 6) for k, v in self.engine_times.items()},
            "probe": self.probe.as_dict() if self.probe is not None else None,
        }


class WeightSender(Protocol):
    """A transport's trainer side (`BroadcastSender`, `CudaIpcSender`,
    `CheckpointSender`): `init(engines)` -> `sync(weights, version)` per
    iteration -> `close()`."""

    transport: str
    config: SyncConfig

    def init(self, engines: list[Any]) -> Any: ...
    def sync(
        self,
        weights: Sequence[tuple[str, Any]],
        version: int,
        probe: ProbeReference | None = None,
    ) -> SyncReport:
        """Push `weights` as `version`; each engine checks `probe` (the
        trainer's reference logprobs) before it serves them."""
        ...

    def summary(self) -> dict[str, Any]:
        """What `init` set up, for the trainer's log line."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SenderOptions:
    """What a trainer tells any transport's sender; each takes what it needs."""

    config: SyncConfig
    #: The device of the trainer's weights, asked only by a sender that needs
    #: it (asking makes the trainer's `named_weights()`).
    weights_device: Callable[[], Any]
    backend: str = "gloo"  # the collective broadcast's: "gloo" | "nccl"
    checkpoint_dir: str | None = None
    #: A trainer that trains a LoRA adapter (`formats.adapter.LoraSync`): the adapter
    #: alone is sent, over the transport's way of moving it.
    lora: Any = None


class EngineHost(Protocol):
    """What the engine actor gives its `WeightSync` (RolloutEngine has all of it)."""

    config: Any  # EngineConfig: name, rpc_timeout_s, tensor_parallel_size
    weight_version: int  # stamped on every output
    stale: bool  # refuses work while True

    async def pause_generation(self) -> None: ...
    async def resume_generation(self) -> None: ...
    async def reset_prefix_cache(self) -> bool: ...
    async def wake_up(self, tags: list[str] | None = None) -> None: ...
    async def probe_logprobs(self, token_ids: list[int]) -> list[float] | None:
        """Logprobs of `token_ids[1:]` on the weights loaded, past the door;
        None when it cannot run one now."""
        ...

    def served_quantization(self) -> str | None: ...

    def hold_outputs(self) -> None: ...
    def release_outputs(self, error: BaseException | None) -> None: ...

    #: `RolloutEngine.collective_rpc(method, args=(), kwargs=None,
    #: timeout_s=None)`, results in rank order; its signature is written
    #: there once (and in each backend), not restated here.
    collective_rpc: Callable[..., Awaitable[list[Any]]]


@dataclass(frozen=True)
class Begun:
    """A sync opened on one engine (generation paused)."""

    engine: str
    version: int
    backup_bytes: int = 0
    #: Per worker, the weight group it is in: a trainer learns whether its
    #: group is intact without another call.
    group_ids: tuple[str | None, ...] = ()
    pause_s: float = 0.0
    prepare_s: float = 0.0

    @property
    def times(self) -> dict[str, float]:
        return {"pause_s": self.pause_s, "prepare_s": self.prepare_s}


@dataclass(frozen=True)
class Received:
    """One receive on one engine: rank 0's figures, and what every worker
    returns that the trainer must check or wait on."""

    engine: str
    bytes: int = 0
    #: Per worker, `{name: checksum}` of what it received (with `verify`).
    checksums: tuple[dict[str, str], ...] | None = None
    #: Per worker, the IPC handle of a CUDA event recorded after its copies.
    copies_done: tuple[bytes, ...] | None = None
    times: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class OneCall:
    """`begin_and_receive`: begin, a receive and maybe the commit, in one call."""

    begun: Begun
    received: Received
    committed: bool
    call_s: float
    probe: ProbeResult | None = None  # the commit's, when `committed`
    #: When the engine actor took the call, had its workers' answers to the
    #: receive, and answered (time.monotonic()).
    actor_at: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def times(self) -> dict[str, float]:
        actor_in, received, actor_out = self.actor_at
        return {
            **self.begun.times,
            **self.received.times,
            "call_s": self.call_s,
            "actor_in_at": actor_in,
            "received_at": received,
            "actor_out_at": actor_out,
        }

    @property
    def checksums(self) -> tuple[dict[str, str], ...] | None:
        return self.received.checksums


@dataclass(frozen=True)
class Committed:
    engine: str
    version: int
    bytes: int
    verified: bool
    probe: ProbeResult | None = None


@dataclass(frozen=True)
class Aborted:
    engine: str
    aborted: bool
    stale: bool
    version: int
    restored: bool = False


@dataclass(frozen=True)
class WeightStatus:
    engine: str
    version: int
    stale: bool
    syncing: int | None


@dataclass
class WorkerAnswer:
    """A worker's answer to a receive, as plain data for vLLM's RPC."""

    bytes: int = 0
    #: Manifest mismatches found in the worker (exception types do not
    #: survive vLLM's RPC): the engine aborts and raises them.
    problems: list[str] = field(default_factory=list)
    #: The worker keeps something of this sync (checksums, a backup) that
    #: `end_weight_sync` must drop; a CUDA IPC receive keeps nothing.
    holds_sync_state: bool = True
    checksums: dict[str, str] | None = None
    copies_done: bytes | None = None
    times: dict[str, float] = field(default_factory=dict)

    def plain(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, plain: dict[str, Any]) -> WorkerAnswer:
        return cls(**plain)


# --- transports -------------------------------------------------------------------------
EngineMethod = Callable[..., Any]  # async (sync: WeightSync, *args) -> answer
WorkerMethod = Callable[..., Any]  # (worker: WorkerWeights, *args) -> plain data


@dataclass(frozen=True)
class Transport:
    """A transport's engine-actor and worker methods, by the name each is
    called under (on the engine actor, and through `collective_rpc`)."""

    name: str
    engine_methods: Mapping[str, EngineMethod] = field(default_factory=dict)
    worker_methods: Mapping[str, WorkerMethod] = field(default_factory=dict)
    #: Engine methods `begin_and_receive` may run: receives whose bytes the
    #: engine pulls itself, so no trainer step has to follow begin.
    one_call: tuple[str, ...] = ()
    #: The trainer side, for transports whose trainer is ours (OpenRLHF's
    #: and vLLM's trainers bring their own).
    new_sender: Callable[[SenderOptions], WeightSender] | None = None
