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
    #: The tolerance per unit roundoff (`roundoff_bound`: `tolerance_for`'s
    #: K, c·sqrt(layers), times the logit scale), for an engine that rounds
    #: what it is sent more coarsely than the dtypes the trainer knows
    #: (`tolerance_on`); 0: never looser.
    per_roundoff: float = 0.0

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

    def tolerance_on(self, quantization: str | None) -> float | None:
        """The tolerance on an engine that quantizes the weights it is sent
        (vLLM's `quantization` of the model it serves; None: it serves the
        dtype sent). Its weights and activations round at that format's unit
        roundoff, scaled as `tolerance_for` scales a dtype's. None: a format
        whose roundoff is not known here."""
        if quantization is None:
            return self.tolerance
        if quantization not in QUANTIZED_ROUNDOFF:
            return None
        return max(self.tolerance, self.per_roundoff * QUANTIZED_ROUNDOFF[quantization])


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


#: Unit roundoff (2^-mantissa bits) of the dtypes a probe meets.
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
#: The unit roundoff standing for the rounding of a format an engine
#: quantizes to on its own, which the trainer's reference, computed in its
#: dtype, cannot see. vLLM's online "fp8" (e4m3: 3 mantissa bits, 2^-4 at
#: worst; weights scaled per tensor, activations per token): measured as
#: bf16's c was (`ROUNDING_UNITS`), its c came to at most 0.73 at 2^-4
#: (the tiny model on CPU over 20 syncs, tests/fp8_emulation.py; 0.44 in
#: the GPU format matrix's FP8 engine), so 2^-5 with c = 2.6 leaves 1.8x
#: room over the worst (bf16's: 2x).
QUANTIZED_ROUNDOFF = {"fp8": 2.0**-5}
#: K per square root of a layer (`tolerance_for`): the CPU measurement's
#: worst, 1.3 (docs/weight_sync.md), with 2x room.
ROUNDING_UNITS = 2.6
#: The least tolerance: the same weights in the same dtype still differ in
#: summation order (other kernels, batch shapes, CPU vs GPU, TF32 matmuls),
#: ~1e-5 on float32 models; 1e-3 leaves room.
TOLERANCE_FLOOR = 1e-3


def unit_roundoff(dtype: Any) -> float:
    name = str(dtype).removeprefix("torch.")
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"no probe tolerance for dtype {dtype!r}: one of {sorted(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[name]


def tolerance_for(dtypes: list[Any], logit_scale: float, layers: int) -> float:
    """The mean |difference| allowed between the trainer's and an engine's
    logprobs over the probe prompt, from the dtypes the two sides meet (the
    reference model's, the dtype sent, the engine's weights and compute)
    and the size of the reference's logits.

    The engine's weights, and every activation it computes, are rounded to
    its dtype; u, the coarsest unit roundoff among `dtypes`, bounds each
    rounding's relative error (bf16 2^-8, fp16 2^-11, float32 2^-24). A
    logit z_j sums terms that each carry such errors, so it moves by about
    K·u·|z_j|: K counts how the roundings add up. Independent roundings
    add up as a random walk, a few per layer, so K = c·sqrt(layers), c
    measured (`ROUNDING_UNITS`). A logprob, z_t -
    logsumexp(z), then moves by δ_t - Σ_j p_j δ_j, at most K·u·(|z_t| +
    Σ_j p_j |z_j|): `logit_scale` is that sum, averaged over the prompt's
    positions (`reference`). Averaging |difference| over the 15 positions
    steadies it, so the bound holds for the mean with room. So a model
    whose logits are large (a sharper, trained one) is allowed more, and a
    small-logit one less, where a tolerance by dtype name alone flagged
    correct bf16 syncs of the one and missed corruptions of the other."""
    worst = max(unit_roundoff(dtype) for dtype in dtypes)
    return max(TOLERANCE_FLOOR, roundoff_bound(logit_scale, layers) * worst)


def roundoff_bound(logit_scale: float, layers: int) -> float:
    """`tolerance_for`'s bound per unit roundoff: K = c·sqrt(layers) times
    the logit scale."""
    return ROUNDING_UNITS * math.sqrt(layers) * logit_scale


def _probe_logits(model: Any, token_ids: tuple[int, ...] | list[int]) -> tuple[Any, Any]:
    """The float32 logits of positions 0..n-2 and the ids they predict, in
    eval mode (no dropout: the engine runs none), the model's mode restored."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], device=device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
    finally:
        model.train(training)
    return logits, ids[0, 1:, None]


def sequence_logprobs(model: Any, token_ids: tuple[int, ...] | list[int]) -> list[float]:
    """Logprobs of `token_ids[1:]` under a transformers causal LM, in float32."""
    import torch

    logits, targets = _probe_logits(model, token_ids)
    return torch.log_softmax(logits, -1).gather(1, targets)[:, 0].tolist()


def reference(model: Any, vocab_size: int, dtype: Any, engine_dtype: Any = None) -> ProbeReference:
    """The trainer's side: the probe prompt's logprobs under `model` (the
    weights being sent, or their master copy), in eval mode, and their
    tolerance (`tolerance_for`) from the model's dtype, the dtype sent
    (`dtype`) and the engine's (`engine_dtype`; None: the one sent)."""
    import torch

    tokens = probe_tokens(vocab_size)
    logits, targets = _probe_logits(model, tokens)
    logprobs = torch.log_softmax(logits, -1)
    # |z_t| + sum_j p_j |z_j| at each position, averaged (tolerance_for).
    per_position = logits.abs().gather(1, targets)[:, 0] + (logprobs.exp() * logits.abs()).sum(-1)
    scale = float(per_position.mean())
    dtypes = [next(model.parameters()).dtype, dtype, engine_dtype or dtype]
    layers = model.config.num_hidden_layers
    return ProbeReference(
        tokens,
        tuple(logprobs.gather(1, targets)[:, 0].tolist()),
        tolerance_for(dtypes, scale, layers),
        roundoff_bound(scale, layers),
    )


async def check(host: Any, probe: ProbeReference, what: str) -> ProbeResult:
    """Run the probe on the engine `host` (its `probe_logprobs`), compare with
    the trainer's; raise `ProbeMismatchError` naming both beyond the
    tolerance on that engine (`ProbeReference.tolerance_on`)."""
    quantization = host.served_quantization()
    tolerance = probe.tolerance_on(quantization)
    if tolerance is None:
        return ProbeResult("skipped", note=f"no probe tolerance for quantization {quantization!r}")
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
    if not mean <= tolerance:
        worst = max(range(len(diffs)), key=lambda i: diffs[i] if math.isfinite(diffs[i]) else 1e300)
        raise ProbeMismatchError(
            f"{what}: the probe's logprobs differ from the trainer's: mean |difference| "
            f"{mean:.4g} > tolerance {tolerance:g}; worst at position {worst + 1}: "
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
