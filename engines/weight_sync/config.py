"""Small configuration records of weight sync (plain data, cross Ray).

Shaped after vLLM's `distributed/weight_transfer/` init/update infos: what it
takes to join the trainer's process group, and how one sync runs.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from typing import Literal

#: Transport backends of the collective broadcast.
BACKENDS = ("gloo", "nccl")
#: What an engine does with its weights when a sync fails part-way.
ON_FAILURE = ("restore", "stale")
DEFAULT_GROUP_NAME = "rolloutflow"


def new_secret() -> str:
    """A fresh weight-group secret: 32 random bytes in urlsafe base64 (the
    form of a Fernet key, which `sealed_store.py` makes of it)."""
    return base64.urlsafe_b64encode(os.urandom(32)).decode()


@dataclass(frozen=True)
class GroupInfo:
    """How the workers of the engines join the trainer's process group: the
    trainer is rank 0 and hosts the rendezvous at `master_address:master_port`
    (listening on that address only); engine `i`'s worker of local rank `r` is
    rank `rank_offset_i + r`.

    `secret` (our trainer always sets one; it reaches the members through Ray):
    the rendezvous store is sealed with it (`sealed_store.py`), so only the
    processes given it can join. None is the layout of OpenRLHF's and vLLM's
    own trainers, which have no secret: anyone reaching the port can join."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = 60.0
    secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.secret is not None:
            try:
                valid = len(base64.urlsafe_b64decode(self.secret.encode())) == 32
            except (binascii.Error, ValueError, AttributeError):
                valid = False
            if not valid:
                # Not echoed: it may be a real secret with a typo.
                raise ValueError("secret must be 32 bytes in urlsafe base64 (config.new_secret())")
        if not self.master_address:
            raise ValueError(
                f"master_address must be a host name or IP, got {self.master_address!r}"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port!r}")
        if self.world_size < 2:
            raise ValueError(
                f"world_size must be >= 2 (trainer + engines), got {self.world_size!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.group_name:
            raise ValueError("group_name must not be empty")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")


@dataclass(frozen=True)
class SyncConfig:
    """How one sync runs.

    - `bucket_bytes`: parameters are packed into flat buffers of about this
      size, one collective per bucket (1 GiB suits GPUs; a parameter larger
      than the bucket travels alone).
    - `timeout_s`: deadline of every collective and of every call into an engine.
    - `verify`: compare checksums of the engines' weights with the trainer's
      before the new version is served.
    - `probe`: before releasing anything computed on the new weights, each
      engine compares its logprobs of a fixed short prompt with the
      trainer's (`probe.py`), when the trainer gives them; a mismatch marks
      that engine stale and fails the requests it held.
    - `on_failure`: `"restore"` keeps a host copy of each engine's weights during
      the sync and puts it back if the sync fails (the engine keeps serving the
      old version; costs host memory of one model per engine); `"stale"` marks
      the engine stale (it refuses work until the next successful sync).
    """

    bucket_bytes: int = 1 << 30
    timeout_s: float = 60.0
    verify: bool = True
    on_failure: Literal["restore", "stale"] = "stale"
    probe: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int):
            raise ValueError(f"bucket_bytes must be an integer, got {self.bucket_bytes!r}")
        if self.bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes must be at least 1024, got {self.bucket_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")
        if self.on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {self.on_failure!r}")
