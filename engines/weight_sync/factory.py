"""The registry of transports: each name mapped to the module that defines
its `TRANSPORT` (`protocol.Transport`: engine-actor methods, worker methods,
the trainer's sender), loaded only when asked for, as vLLM's
`distributed/weight_transfer/factory.py` registers its engines.

Lazy, by module path, so that nothing imports every transport to learn one:
a transport module imports the session, the worker and the coordinator it
runs on, and `protocol.py`, which they all import, must import none of them
back (one circle of files otherwise). Adding a transport is its own module
and one line of `TRANSPORTS`.

`transport_for` is the one place a trainer's transport is chosen, and
`new_sender` makes its trainer side.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from engines.weight_sync.protocol import SenderOptions, Transport, WeightSender

#: Transport name -> the module that defines its `TRANSPORT`.
TRANSPORTS = {
    "broadcast": "engines.weight_sync.transports.broadcast",
    "cuda_ipc": "engines.weight_sync.transports.cuda_ipc",
    "checkpoint": "engines.weight_sync.transports.checkpoint",
    "openrlhf": "engines.weight_sync.compat.openrlhf",
    "vllm_native": "engines.weight_sync.compat.vllm_native",
}
#: Not a transport: a LoRA adapter rides on cuda_ipc, a checkpoint or the
#: call itself (`lora/`). Its engine-actor and worker methods are added to
#: those classes as a transport's are (and its receive may run in
#: `begin_and_receive`), so its method table is loaded beside the transports'.
ADAPTER_METHODS = "engines.weight_sync.lora.methods"


def transports() -> list[Transport]:
    """Every method table the engine actor and its workers answer, their
    modules imported now: the transports', then the LoRA adapters'."""
    modules = [*TRANSPORTS.values(), ADAPTER_METHODS]
    return [importlib.import_module(module).TRANSPORT for module in modules]


def add_transport_methods(cls: type, side: str, wrap: Callable[[Callable], Callable]) -> None:
    """Add every registered transport's `side` methods ("engine_methods" or
    "worker_methods") to `cls`, each made by `wrap` and named as registered.
    A name registered twice, or one `cls` writes itself, is refused."""
    owners = {name: "the class" for name in vars(cls) if not name.startswith("_")}
    for table in transports():
        for name, function in getattr(table, side).items():
            if name in owners:
                raise TypeError(f"{table.name!r} and {owners[name]} both register {name!r}")
            owners[name] = repr(table.name)
            method = wrap(function)
            method.__name__ = method.__qualname__ = name
            setattr(cls, name, method)


def trainer_transports() -> tuple[str, ...]:
    """The transports a trainer of ours can sync with (those with a sender)."""
    return tuple(t.name for t in transports() if t.new_sender is not None)


def transport_for(*, colocated: bool, device: str, checkpoint_dir: str | None = None) -> str:
    """The transport from where the trainer sits: a checkpoint directory when
    one is asked for; CUDA IPC for engines on the trainer's own GPU (one GPU
    cannot hold two NCCL ranks); otherwise the bucketed broadcast (NCCL
    between GPUs, gloo on CPU)."""
    if checkpoint_dir is not None:
        return "checkpoint"
    if colocated and device.startswith("cuda"):
        return "cuda_ipc"
    return "broadcast"


def new_sender(transport: str, options: SenderOptions) -> WeightSender:
    """The trainer side of `transport`, from the registry; with `options.lora`,
    the adapter's sender over that transport's way (`lora.sender.new_sender`)."""
    if options.lora is not None:
        from engines.weight_sync.lora import sender

        return sender.new_sender(transport, options)
    senders = {t.name: t.new_sender for t in transports() if t.new_sender is not None}
    if transport not in senders:
        raise ValueError(f"transport must be one of {tuple(senders)}, got {transport!r}")
    return senders[transport](options)
