"""Who gets into a weight group: the rendezvous listens on the address given
only, and with the group's secret a process that is not a member cannot
join, read the rendezvous or plant a value in it (gloo, in threads and a
stranger process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from engines.weight_sync.config import GroupInfo, new_secret
from engines.weight_sync.errors import WeightTransferError
from engines.weight_sync.group import WeightGroup, free_port, listen

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
TIMEOUT_S = 10.0


def listening_addresses(port: int) -> list[str]:
    """The local addresses of the sockets listening on `port` (from the kernel)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if len(raw) == 4:
                    found.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.append(socket.inet_ntop(socket.AF_INET6, words))
    return found


def form(info: GroupInfo, ranks, listener=None) -> dict[int, WeightGroup | Exception]:
    """The members of `ranks` join `info`'s group, each in a thread."""
    joined: dict[int, WeightGroup | Exception] = {}

    def member(rank: int) -> None:
        try:
            joined[rank] = WeightGroup(info, rank, listener=listener if rank == 0 else None)
        except Exception as exc:  # noqa: BLE001 - checked by the test
            joined[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(info.timeout_s + 10)
    return joined


def broadcast(groups: dict[int, WeightGroup], tensor: torch.Tensor) -> dict[int, torch.Tensor]:
    received = {r: tensor.clone() if r == 0 else torch.zeros_like(tensor) for r in groups}
    threads = [threading.Thread(target=groups[r].broadcast, args=(received[r],)) for r in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S * 2)
    return received


def test_rendezvous_listens_on_the_given_address_only():
    """Rank 0 given no socket binds one itself, to the group's address."""
    info = GroupInfo("127.0.0.1", listen_port := free_port(), 2, "bound", "gloo", TIMEOUT_S)
    groups = form(info, (0, 1))
    try:
        assert all(isinstance(g, WeightGroup) for g in groups.values()), groups
        assert listening_addresses(listen_port) == ["127.0.0.1"]
        # 127.0.0.2 is this host too: a socket on every interface would take it.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", listen_port), timeout=2).close()
    finally:
        for group in groups.values():
            group.destroy()


def test_a_stranger_claiming_a_rank_gets_nothing():
    """The stranger connects first and claims rank 1 the way a trainer without
    a secret lays its group out; the members, sealed with the secret, form
    the group and broadcast without it; it reads nothing useful and receives
    nothing."""
    listener = listen("127.0.0.1")
    port = listener.getsockname()[1]
    # A deadline for the members that covers the stranger's start (importing
    # torch on a loaded machine); the stranger waits 3 s to be let in.
    info = GroupInfo("127.0.0.1", port, 2, "sealed", "gloo", 120.0, new_secret())
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    stranger = subprocess.Popen(
        [sys.executable, str(HERE / "stranger.py"), "127.0.0.1", str(port), "sealed", "2", "1"]
        + ["16", "3"],
        env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Rank 0 listens; the stranger is connected before any member joins.
        trainer: dict[int, WeightGroup | Exception] = {}
        thread = threading.Thread(target=lambda: trainer.update(form(info, (0,), listener)))
        thread.start()
        assert stranger.stdout.readline().strip() == "connected"
        groups = form(info, (1,))
        thread.join(info.timeout_s)
        groups.update(trainer)
        assert all(isinstance(g, WeightGroup) for g in groups.values()), groups
        sent = torch.arange(16, dtype=torch.float32)
        received = broadcast(groups, sent)
        assert torch.equal(received[1], sent)
        out, err = stranger.communicate(timeout=info.timeout_s)
    finally:
        stranger.kill()
        stranger.wait()
        for group in locals().get("groups", {}).values():
            if isinstance(group, WeightGroup):
                group.destroy()
    lines = out.splitlines()
    assert lines[-1].startswith("refused:"), (out, err)
    assert not any(line.startswith("joined") for line in lines)


def test_a_member_with_another_secret_cannot_join():
    info = GroupInfo("127.0.0.1", free_port(), 2, "sealed", "gloo", 2.0, new_secret())
    impostor = GroupInfo("127.0.0.1", info.master_port, 2, "sealed", "gloo", 2.0, new_secret())
    joined: dict[int, WeightGroup | Exception] = {}
    threads = [
        threading.Thread(target=lambda: joined.update(form(info, (0,)))),
        threading.Thread(target=lambda: joined.update({1: form(impostor, (1,))[1]})),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert isinstance(joined[0], WeightTransferError), joined
    assert isinstance(joined[1], WeightTransferError), joined
    assert "could not join weight group 'sealed'" in str(joined[0])


def test_group_info_refuses_a_malformed_secret():
    with pytest.raises(ValueError, match="secret must be 32 bytes") as caught:
        GroupInfo("127.0.0.1", 1234, 2, secret="not-a-key")
    assert "not-a-key" not in str(caught.value)
    assert "secret" not in repr(GroupInfo("127.0.0.1", 1234, 2, secret=new_secret()))


@pytest.mark.parametrize("lost_rank", [0, 1])
def test_a_member_gone_after_the_store_ends_the_join_within_the_deadline(lost_rank):
    """A member that reached the sealed store and never joined gloo (died
    between the two): the others wait for its keys through the sealed store,
    a Python store whose own timeout is torch's default of 300 s; the join
    still ends at the group's deadline."""
    from engines.weight_sync.group import rendezvous_store

    info = GroupInfo("127.0.0.1", free_port(), 2, "sealed", "gloo", 2.0, new_secret())
    stores = []
    rank = 1 - lost_rank
    lost = threading.Thread(
        target=lambda: stores.append(rendezvous_store(info, lost_rank)), daemon=True
    )
    lost.start()
    joined: dict[int, WeightGroup | Exception] = {}
    member = threading.Thread(target=lambda: joined.update(form(info, (rank,))), daemon=True)
    member.start()
    member.join(TIMEOUT_S * 3)
    assert not member.is_alive(), f"rank {rank} still waits for the lost member past the deadline"
    assert isinstance(joined[rank], WeightTransferError), joined
    assert "within 2s" in str(joined[rank])
