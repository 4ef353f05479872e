"""The sealed rendezvous store: what a process without the secret sees and
can do through the TCPStore underneath."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from engines.weight_sync.config import new_secret
from engines.weight_sync.errors import WeightTransferError
from engines.weight_sync.group import listen
from engines.weight_sync.sealed_store import SealedStore

TIMEOUT = timedelta(seconds=5)


@pytest.fixture
def stores():
    """A sealed member's store and a stranger's raw client of the same server."""
    listener = listen("127.0.0.1")
    port = listener.getsockname()[1]
    server = TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        timeout=TIMEOUT,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        use_libuv=False,
    )
    stranger = TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT, use_libuv=False)
    secret = new_secret()
    yield SealedStore(server, secret, "g"), stranger, secret


def test_a_stranger_learns_neither_names_nor_values(stores):
    member, stranger, _ = stores
    member.set("rank_0", b"10.0.0.5:41234")
    assert member.get("rank_0") == b"10.0.0.5:41234"
    (listed,) = stranger.list_keys()
    assert "rank" not in listed
    assert b"10.0.0.5" not in stranger.get(listed)


def test_a_planted_or_moved_value_is_refused_naming_the_key(stores):
    member, stranger, _ = stores
    member.set("rank_0", b"addr-0")
    member.set("rank_1", b"addr-1")
    name_0, name_1 = (member._name(k) for k in ("rank_0", "rank_1"))
    # A member's value moved under another key: sealed with its own name.
    stranger.set(name_1, stranger.get(name_0))
    with pytest.raises(WeightTransferError, match="'rank_1' holds a value no member wrote"):
        member.get("rank_1")
    stranger.set(name_0, b"attacker:1")
    with pytest.raises(WeightTransferError, match="weight group 'g': rendezvous key 'rank_0'"):
        member.get("rank_0")


def test_members_with_the_secret_share_it(stores):
    member, client, secret = stores
    other = SealedStore(client, secret, "g")
    member.set("k", "v")
    assert other.get("k") == b"v"
    other.wait(["k"], TIMEOUT)
    assert other.check(["k"]) and other.add("n", 2) == 2 and member.add("n", 1) == 3
