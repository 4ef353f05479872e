"""The engine arguments the CPU backend reads (`HFOptions`), and its checks of
them: run on the driver before any engine exists (`HFEngine.check_settings`,
asked by `EngineSetSpec.engine_kwargs_for`), and again as the engine starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from engines.errors import EngineSpecError

logger = logging.getLogger(__name__)

# What the CPU backend does with engine arguments; the rest are vLLM-only
# (enforce_eager, enable_sleep_mode, ...) and ignored there.
HF_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass(frozen=True)
class HFOptions:
    """The engine arguments this backend reads (vLLM's others it ignores)."""

    dtype: str
    max_num_seqs: int
    # vLLM's: logprobs of the raw distribution, or of the one sampled from
    # (after temperature, top-k, top-p); at most `max_logprobs` per token.
    processed_logprobs: bool
    max_logprobs: int
    trust_remote_code: bool

    @classmethod
    def from_engine_kwargs(cls, engine_kwargs: dict[str, Any]) -> HFOptions:
        kwargs = dict(engine_kwargs)
        check_hf_kwargs(kwargs)
        options = cls(
            dtype=kwargs.pop("dtype", "auto"),
            max_num_seqs=int(kwargs.pop("max_num_seqs", 64)),
            processed_logprobs=kwargs.pop("logprobs_mode", "raw_logprobs") != "raw_logprobs",
            max_logprobs=int(kwargs.pop("max_logprobs", 20)),
            trust_remote_code=bool(kwargs.pop("trust_remote_code", False)),
        )
        if kwargs:
            logger.info("backend 'hf' ignores vLLM engine arguments %s", sorted(kwargs))
        return options


def check_hf_kwargs(kwargs: dict[str, Any]) -> None:
    dtype = kwargs.get("dtype", "auto")
    if dtype not in HF_DTYPES:
        raise EngineSpecError(f"dtype={dtype!r} is not one of {list(HF_DTYPES)} (backend 'hf')")
    mode = kwargs.get("logprobs_mode", LOGPROBS_MODES[0])
    if mode not in LOGPROBS_MODES:
        raise EngineSpecError(
            f"logprobs_mode={mode!r} is not supported by backend 'hf'; use one of "
            f"{list(LOGPROBS_MODES)}"
        )
