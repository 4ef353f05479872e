"""Error types of the engine layer.

Two families matter to callers: `EngineSpecError` (bad input, raised before
anything is created) and `EngineFailure` (an engine died or hung: the caller
may replace the engine and retry). A per-request problem such as a prompt that
is too long is neither: the engine keeps serving.
"""


class EngineSpecError(ValueError):
    """An invalid engine specification; nothing was created."""


class BackendUnavailableError(EngineSpecError):
    """The requested backend cannot run on this cluster (no GPU, no vLLM)."""


class RequestError(ValueError):
    """A single request was rejected; the engine keeps serving."""


class PromptTooLongError(RequestError):
    """A prompt does not fit in the engine's `max_len`."""


class EngineSleepingError(RequestError):
    """Work was sent to an engine that is asleep (call `wake_up` first)."""


class EngineFailure(RuntimeError):
    """An engine can no longer serve: the caller should replace it."""

    def __init__(self, message: str, engine: str | None = None):
        super().__init__(message)
        self.engine = engine


class EngineDeadError(EngineFailure):
    """The engine's actor (or its inference engine) died."""


class EngineTimeoutError(EngineFailure):
    """The engine did not answer within the deadline (hung or overloaded)."""


class EngineStaleError(EngineFailure):
    """The engine's new weights failed the probe after a sync (the engine is
    marked stale): a request computed on them was not answered. Resync or
    replace the engine and send it again."""
