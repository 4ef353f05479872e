"""The probe after every sync: before an engine releases anything computed
on the new weights, it computes the logprobs of a fixed short prompt (prompt
logprobs of fixed token ids: deterministic, no sampling) and compares them
with the trainer's, computed on the weights it sent. A mismatch beyond the
tolerance marks that engine stale, naming both values.

Trainer: `reference(model, ...)` -> `ProbeReference`, passed to the sender's
`sync(..., probe=...)`, which hands it to each engine's commit
(`finish_weight_sync(probe=...)`). Engine: the commit serves the new weights
at once and `ProbeRuns` runs `check` (the host's `probe_logprobs`) beside the
first requests let in, whose outputs wait for its verdict. The commit's call
returns with the verdict, so the sync's `SyncReport.probe` is final and a
mismatch raises from the sync that caused it: the trainer never reads
"passed" before it is so, and the engine's first work does not wait for it.
A trainer that gives no reference (OpenRLHF's or vLLM's own calls, a
hand-driven session) is not probed: the report and the engine's log say
"skipped" (an engine cannot tell right weights from wrong ones on its own).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from engines.errors import EngineStaleError
from engines.weight_sync.errors import ProbeMismatchError

logger = logging.getLogger(__name__)

#: Tokens in the probe prompt: 15 logprobs, one short forward pass.
PROBE_LENGTH = 16
#: Ids are spread over the vocabulary by this stride (a prime): different
#: embedding rows, no tokenizer needed on either side.
STRIDE = 7919


@dataclass(frozen=True)
class ProbeReference:
    """The trainer's logprobs of `token_ids[1:]`, each given the ids before
    it, and the mean absolute difference an engine may show."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    tolerance: float

    def __post_init__(self) -> None:
        if len(self.token_ids) < 2:
            raise ValueError(f"a probe needs at least 2 tokens, got {len(self.token_ids)}")
        if len(self.logprobs) != len(self.token_ids) - 1:
            raise ValueError(
                f"a probe of {len(self.token_ids)} tokens has {len(self.token_ids) - 1} "
                f"logprobs, got {len(self.logprobs)}"
            )
        if not all(math.isfinite(x) for x in self.logprobs):
            raise ValueError(f"the trainer's probe logprobs are not finite: {self.logprobs}")
        if not self.tolerance > 0:
            raise ValueError(f"tolerance must be positive, got {self.tolerance!r}")


@dataclass(frozen=True)
class ProbeResult:
    """What the probe did: "passed", "skipped" (no reference, or no way to
    run it now: `note` says why) or "off" (`SyncConfig.probe=False`). A
    failed probe raises `ProbeMismatchError` instead. Differences are mean
    and max |engine - trainer| over the prompt; seconds are the slowest
    engine's."""

    status: Literal["passed", "skipped", "off"]
    seconds: float = 0.0
    mean_diff: float | None = None
    max_diff: float | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "seconds": round(self.seconds, 6),
            "mean_diff": self.mean_diff,
            "max_diff": self.max_diff,
            "note": self.note,
        }


def probe_tokens(vocab_size: int) -> tuple[int, ...]:
    """The fixed probe prompt for a vocabulary of `vocab_size` usable ids."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size!r}")
    return tuple((3 + i * STRIDE) % vocab_size for i in range(PROBE_LENGTH))


def tolerance_for(dtype: Any) -> float:
    """The mean |difference| allowed between the trainer's and an engine's
    logprobs, from the dtype of the weights sent. float32: both sides run the
    same weights and differ only in summation order (other kernels, batch
    shapes, CPU vs GPU), ~1e-5 on our models; 1e-3 leaves room. 16-bit: each
    op rounds to 8 (bf16) or 11 (fp16) mantissa bits and vLLM's kernels are
    not the trainer's; the GPU suite sees means up to 0.007 and maxima up to
    0.03 on its models, and bounds the mean at 0.06 over long samples;
    over 15 positions the mean is noisier, so 0.1. A corrupted bucket moves
    logprobs by whole units or makes them non-finite (always a failure)."""
    return 1e-3 if "float32" in str(dtype) or "float64" in str(dtype) else 0.1


def sequence_logprobs(model: Any, token_ids: tuple[int, ...] | list[int]) -> list[float]:
    """Logprobs of `token_ids[1:]` under a transformers causal LM, in float32."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist()


def reference(model: Any, vocab_size: int, dtype: Any) -> ProbeReference:
    """The trainer's side: the probe prompt's logprobs under `model` (the
    weights being sent, or their master copy), with `dtype`'s tolerance."""
    tokens = probe_tokens(vocab_size)
    return ProbeReference(tokens, tuple(sequence_logprobs(model, tokens)), tolerance_for(dtype))


async def check(host: Any, probe: ProbeReference, what: str) -> ProbeResult:
    """Run the probe on the engine `host` (its `probe_logprobs`), compare with
    the trainer's; raise `ProbeMismatchError` naming both beyond tolerance."""
    started = time.monotonic()
    try:
        got = await host.probe_logprobs(list(probe.token_ids))
    except TimeoutError:
        # No evidence against the weights: on vLLM the probe waits behind the
        # requests a "keep" pause preempted (re-prefilled first), and marking
        # a sound engine stale would refuse all of them.
        seconds = time.monotonic() - started
        logger.warning("%s: the probe had no answer in %.1fs; not checked", what, seconds)
        return ProbeResult("skipped", seconds, note=f"no answer in {seconds:.1f}s")
    seconds = time.monotonic() - started
    if got is None:
        return ProbeResult("skipped", seconds, note="the engine cannot run a request now")
    if len(got) != len(probe.logprobs):
        raise ProbeMismatchError(
            f"{what}: the probe gave {len(got)} logprobs, the trainer {len(probe.logprobs)}"
        )
    diffs = [abs(g - r) for g, r in zip(got, probe.logprobs, strict=True)]
    finite = all(math.isfinite(d) for d in diffs)
    mean = sum(diffs) / len(diffs) if finite else math.inf
    if not mean <= probe.tolerance:
        worst = max(range(len(diffs)), key=lambda i: diffs[i] if math.isfinite(diffs[i]) else 1e300)
        raise ProbeMismatchError(
            f"{what}: the probe's logprobs differ from the trainer's: mean |difference| "
            f"{mean:.4g} > tolerance {probe.tolerance:g}; worst at position {worst + 1}: "
            f"engine {got[worst]:.4f}, trainer {probe.logprobs[worst]:.4f} "
            f"(engine {_short(got)}, trainer {_short(probe.logprobs)})"
        )
    return ProbeResult("passed", seconds, mean_diff=mean, max_diff=max(diffs))


def _short(values: Any) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in list(values)[:6]) + ", ...]"


def combined(results: list[ProbeResult]) -> ProbeResult:
    """One result for the engines of a sync: the slowest probe's seconds,
    the largest differences; skipped if any engine skipped."""
    if not results:
        return ProbeResult("skipped", note="no engine committed")
    skipped = [r for r in results if r.status != "passed"]
    if skipped:
        return ProbeResult("skipped", max(r.seconds for r in results), note=skipped[0].note)
    return ProbeResult(
        "passed",
        max(r.seconds for r in results),
        mean_diff=max(r.mean_diff or 0.0 for r in results),
        max_diff=max(r.max_diff or 0.0 for r in results),
    )


class ProbeRuns:
    """The probe of each commit on one engine, riding with its first work:
    the engine commits and lets requests in at once, the probe among them,
    but holds what they compute (`hold_outputs`, before the door opens)
    until the verdict (`release_outputs`). A mismatch marks the engine stale
    first, back at the version it served before (a failed sync never moves
    it on): the held calls fail with `EngineStaleError`, which callers treat
    as an engine failure (requeue the work elsewhere), and nothing computed
    on those weights is served."""

    def __init__(self, host: Any, name: str):
        self.host, self.name = host, name
        self._last: asyncio.Task | None = None

    async def resume(self, probe: ProbeReference, version: int, previous: int) -> asyncio.Task:
        """Resume the engine on `version`, just committed over `previous`,
        its outputs held from before the door opens (frozen requests' too),
        and start the probe: started as the door opens, it enters the engine
        with the first calls let in and shares their batch. A resume that
        fails starts no probe: the held calls fail at once instead of
        waiting on a verdict for ever."""
        self.host.hold_outputs()
        try:
            await self.host.resume_generation()
        except BaseException as exc:
            self._refuse(version, previous, f"resuming failed ({exc!r}); its probe did not run")
            raise
        self._last = asyncio.ensure_future(self._judge(probe, version, previous))
        return self._last

    async def settled(self) -> None:
        """Wait for the last probe (its error is its own commit's): the next
        sync must not replace the weights it reads."""
        if self._last is not None:
            await asyncio.wait([self._last])

    async def _judge(self, probe: ProbeReference, version: int, previous: int) -> ProbeResult:
        try:
            result = await check(self.host, probe, f"engine {self.name}, version {version}")
        except BaseException as exc:
            self._refuse(version, previous, f"its probe failed: {exc}")
            logger.error(
                "engine %s: weight version %d failed its probe (%s) - STALE, resync needed",
                self.name,
                version,
                exc,
            )
            raise
        self.host.release_outputs(None)
        return result

    def _refuse(self, version: int, previous: int, why: str) -> None:
        """Before anything else runs: the engine stale, back at `previous`,
        and no call let in on `version`'s weights (the held ones fail)."""
        self.host.stale, self.host.weight_version = True, previous
        self.host.release_outputs(
            EngineStaleError(
                f"engine {self.name}: nothing computed on weight version {version} is "
                f"served, {why}",
                engine=self.name,
            )
        )
