"""Error types of weight sync.

`WeightSyncError` is recoverable: the sync did not happen (or was rolled back),
every engine still serves a consistent set of weights (or refuses work while
marked stale), and the caller may fix the input or rebuild the group and retry.
An engine that died is not a weight-sync error: it is
`engines.errors.EngineDeadError`, and the caller replaces the engine.
"""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight sync failed without killing an engine; retrying can succeed."""


class ManifestMismatchError(WeightSyncError, ValueError):
    """The trainer's parameters (names, shapes, dtypes) do not match an engine's.
    Raised before any byte moves; nothing changed."""


class WeightVersionError(WeightSyncError, ValueError):
    """A sync asked for a version that is not newer than the one served."""


class ChecksumMismatchError(WeightSyncError):
    """After the transfer, an engine's weights differ from the trainer's."""


class ProbeMismatchError(WeightSyncError):
    """After a sync, an engine's logprobs of the probe prompt differ from the
    trainer's beyond the tolerance: the engine was not let serve them
    (`probe.py`)."""


class WeightTransferError(WeightSyncError):
    """A collective or transfer failed or timed out (a peer died or hung). The
    process group is torn down; build a new one before the next sync."""
