"""The process group that carries weights from the trainer (rank 0) to every
engine worker, shared by the transports that broadcast (bucketed, OpenRLHF's
per-parameter, vLLM's native NCCL): gloo through torch.distributed on CPUs, NCCL through vLLM's
`StatelessProcessGroup` + `PyNcclCommunicator` on GPUs (what OpenRLHF and
vLLM's RLHF examples use).

Who gets in: rank 0 listens on `GroupInfo.master_address` only (a socket we
bind and hand to the TCPStore, which would otherwise listen on every
interface), and with `GroupInfo.secret` the store is sealed
(`sealed_store.py`): a process without the secret cannot read the rendezvous
(gloo's addresses, NCCL's unique id), claim a rank, or plant a value a member
would read (the join fails naming the key instead).

Compatibility: without a secret, the gloo group is laid out exactly as
OpenRLHF's `init_process_group(backend="gloo", init_method="tcp://addr:port",
group_name=...)` helper lays out its group (a TCPStore under `PrefixStore(group_name)`,
then torch's own per-group and per-device prefixes), so a trainer that builds
its group with that helper (torch.distributed only) joins ours and vice
versa; the NCCL group is vLLM's `StatelessProcessGroup.create` rendezvous. Such
foreign trainers have no secret, so their groups are as open as upstream's;
with a secret (our `BroadcastSender`) only our members can join.

Every collective has a deadline: gloo's own timeout; for NCCL, which has none,
a watchdog polls the CUDA event and aborts the communicator
(`ncclCommAbort`) when the deadline passes (NCCL collectives hang forever
when a peer dies: https://github.com/NVIDIA/nccl/issues/585).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any

from engines.weight_sync.config import GroupInfo
from engines.weight_sync.errors import WeightTransferError

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port free right now on this host (the trainer binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def listen(address: str, port: int = 0) -> socket.socket:
    """A socket listening on `address` only (port 0: one the OS picks), for
    rank 0's rendezvous store."""
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def rendezvous_address(worker_nodes: list[list[str]]) -> str:
    """Where the trainer's rendezvous listens: loopback when every engine
    worker is on the trainer's node, else the node's cluster address (the
    one Ray's nodes reach it by)."""
    import ray

    here = ray.util.get_node_ip_address()
    if all(node == here for nodes in worker_nodes for node in nodes):
        return "127.0.0.1"
    return here


def rendezvous_store(info: GroupInfo, rank: int, listener: socket.socket | None = None) -> Any:
    """The group's store: rank 0 serves it on `listener` (by default a socket
    bound to `info.master_address:info.master_port`), the others connect.
    Sealed with `info.secret` when there is one."""
    from torch.distributed import TCPStore

    fd = None
    if rank == 0:
        listener = listener or listen(info.master_address, info.master_port)
        fd = listener.detach()  # the store owns it from here
    try:
        store = TCPStore(
            info.master_address,
            info.master_port,
            info.world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=info.timeout_s),
            wait_for_workers=True,
            master_listen_fd=fd,
            # As vLLM's StatelessProcessGroup.create, which keeps libuv off
            # "for now" when handing in a listen fd:
            # https://github.com/pytorch/pytorch/pull/150215
            use_libuv=False,
        )
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    if info.secret is None:
        return store
    from engines.weight_sync.sealed_store import SealedStore

    return SealedStore(store, info.secret, info.group_name)


class WeightGroup:
    """One member's handle on the weight-sync group (trainer or engine worker).
    Rank 0 may pass the `listener` whose port is `info.master_port` (bound
    before `info` was made, so the port is never raced for)."""

    def __init__(
        self,
        info: GroupInfo,
        rank: int,
        device: Any = None,
        listener: socket.socket | None = None,
    ):
        if not 0 <= rank < info.world_size:
            raise ValueError(f"rank {rank} is outside the group of {info.world_size}")
        self.info = info
        self.rank = rank
        self.device = device
        self._store = None
        self._gloo = None
        self._nccl = None
        self._stream = None
        started = time.monotonic()
        try:
            store = rendezvous_store(info, rank, listener)
            if info.backend == "gloo":
                self._join_gloo(store)
            else:
                self._join_nccl(store)
        except WeightTransferError:
            raise
        except Exception as exc:  # noqa: BLE001 - one error type for a failed join
            raise WeightTransferError(
                f"rank {rank} could not join weight group {info.group_name!r} at "
                f"{info.master_address}:{info.master_port} (world {info.world_size}) "
                f"within {info.timeout_s:g}s: {exc}"
            ) from exc
        logger.info(
            "rank %d joined weight group %r (%s, world %d) in %.2fs",
            rank,
            info.group_name,
            info.backend,
            info.world_size,
            time.monotonic() - started,
        )

    @property
    def group_id(self) -> str:
        """Names the group: members compare it to know they are in the same one."""
        return f"{self.info.master_address}:{self.info.master_port}/{self.info.group_name}"

    @property
    def alive(self) -> bool:
        return self._gloo is not None or self._nccl is not None

    # --- gloo -------------------------------------------------------------------
    def _join_gloo(self, store: Any) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo

        timeout = timedelta(seconds=self.info.timeout_s)
        self._store = store
        name = self.info.group_name
        # The same prefixes as torch's `_new_process_group_helper` under
        # OpenRLHF's helper: PrefixStore(group_name) -> "<group_name>/" -> "cpu/".
        store = PrefixStore("cpu/", PrefixStore(f"{name}/", PrefixStore(name, self._store)))
        self._gloo = ProcessGroupGloo(store, self.rank, self.info.world_size, timeout)

    def _broadcast_gloo(self, tensor: Any, src: int) -> None:
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        options.timeout = timedelta(seconds=self.info.timeout_s)
        work = self._gloo.broadcast([tensor], options)
        work.wait(timedelta(seconds=self.info.timeout_s))

    # --- NCCL (GPU only; vLLM imported here) -------------------------------------
    def _join_nccl(self, store: Any) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        # What `StatelessProcessGroup.create` builds, on our (sealed) store.
        self._store = StatelessProcessGroup(
            rank=self.rank, world_size=self.info.world_size, store=store
        )
        self._nccl = PyNcclCommunicator(self._store, device=self.device)

    def _start_nccl(self, tensor: Any, src: int) -> Any:
        """Enqueue the broadcast on the group's own stream, after all work
        enqueued so far on the current stream (packing or loading of earlier
        buffers); returns its completion event. A stream of its own lets the
        current stream pack or load one bucket while the next is on the wire."""
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        # The tensor was allocated on another stream: keep the allocator from
        # reusing it before this stream is done with it.
        tensor.record_stream(self._stream)
        self._nccl.broadcast(tensor, src=src, stream=self._stream)
        done = torch.cuda.Event()
        done.record(self._stream)
        return done

    def _wait_nccl(self, done: Any) -> None:
        # NCCL has no deadline of its own: poll, so a dead peer is an error
        # (and an ncclCommAbort in `destroy`) instead of a hang.
        deadline = time.monotonic() + self.info.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"NCCL broadcast did not finish in {self.info.timeout_s:g}s")
            time.sleep(0.0002)

    # --- common -------------------------------------------------------------------
    def broadcast(self, tensor: Any, src: int = 0) -> None:
        """Broadcast `tensor` in place from `src` and wait for it; raises
        WeightTransferError (and tears the group down) if a peer fails or the
        deadline passes."""
        self.wait(self.start_broadcast(tensor, src))

    def start_broadcast(self, tensor: Any, src: int = 0) -> Any:
        """Begin broadcasting `tensor` from `src`; pass the result to `wait`.
        NCCL: runs on the group's stream after what the current stream has
        queued; `tensor` must not be touched until it is waited for (or the
        current stream waits for the result: `torch.cuda.current_stream().wait_event`).
        gloo: done on return (None)."""
        if not self.alive:
            raise WeightTransferError(
                f"weight group {self.info.group_name!r} was torn down; build a new one"
            )
        try:
            if self._gloo is not None:
                self._broadcast_gloo(tensor, src)
                return None
            return self._start_nccl(tensor, src)
        except Exception as exc:  # noqa: BLE001 - every failure ends this group
            raise self._failed(exc) from exc

    def wait(self, pending: Any) -> None:
        """Wait (within the deadline) for a broadcast `start_broadcast` began."""
        if pending is None:
            return
        try:
            self._wait_nccl(pending)
        except Exception as exc:  # noqa: BLE001 - every failure ends this group
            raise self._failed(exc) from exc

    def _failed(self, exc: Exception) -> WeightTransferError:
        self.destroy()
        return WeightTransferError(
            f"broadcast in weight group {self.info.group_name!r} failed on rank {self.rank} "
            f"(deadline {self.info.timeout_s:g}s): {exc}"
        )

    def destroy(self) -> None:
        """Leave the group. Idempotent; the members must build a new group (on a
        new port) to sync again."""
        if self._nccl is not None:
            try:
                self._nccl.destroy()
            except Exception:  # noqa: BLE001 - already broken
                logger.warning("NCCL communicator abort failed", exc_info=True)
        if self._gloo is not None:
            try:
                self._gloo.shutdown()
            except Exception:  # noqa: BLE001 - already broken
                logger.debug("gloo shutdown failed", exc_info=True)
        self._gloo = self._nccl = self._store = self._stream = None
