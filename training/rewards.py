"""Rewards: loaded by import path ("package.module:function"), called on a
batch of samples, and checked (one number per sample, every one finite).

Three calling conventions, chosen by `style`, so existing reward code runs
unchanged:

- "batch" (ours): `fn(samples: list[RewardInput]) -> list[float]`.
- "openrlhf": `reward_func(queries, prompts, labels)`, queries being prompt +
  response text; returns a tensor/list of rewards or a dict with "rewards"
  (OpenRLHF's `--remote_rm_url` file, examples/python/reward_func.py).
- "verl": `compute_score(data_source, solution_str, ground_truth,
  extra_info)` per sample, keyword arguments as verl's reward manager passes
  them; returns a number or a dict with "score". `data_source` and
  `extra_info` are the row's metadata columns of those names.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

RewardStyle = Literal["batch", "openrlhf", "verl"]
STYLES: tuple[str, ...] = ("batch", "openrlhf", "verl")


class RewardError(ValueError):
    """A reward raised, or returned a wrong count or a non-finite value."""


@dataclass(frozen=True)
class RewardInput:
    """One sample as a reward sees it. `id` names the input row (its id
    column, else its position) and `sample` which of its `n` samples."""

    id: Any
    sample: int
    prompt: str
    response: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"id={self.id!r} sample {self.sample}"


BatchReward = Callable[[list[RewardInput]], Sequence[float]]


def load_reward(path: str, style: str = "batch") -> BatchReward:
    """The callable at `path`, adapted to a batch reward: "module:attribute",
    or "file.py:attribute" (as OpenRLHF's `--remote_rm_url reward_func.py`;
    the file must be readable where the reward runs)."""
    if style not in STYLES:
        raise ValueError(f"reward style must be one of {STYLES}, got {style!r}")
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(
            f"reward must be 'package.module:function' or 'file.py:function', got {path!r}"
        )
    module_name, attr = path.split(":")
    try:
        module = import_file(module_name) if module_name.endswith(".py") else None
        module = module or importlib.import_module(module_name)
    except (ImportError, OSError) as exc:
        raise ValueError(f"reward {path!r}: cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {path!r}: {module_name} has no callable {attr!r}")
    if style == "openrlhf":
        return openrlhf_adapter(fn)
    if style == "verl":
        return verl_adapter(fn)
    return fn


def import_file(path: str) -> Any:
    """The module in the Python file at `path`."""
    location = Path(path)
    if not location.is_file():
        raise ImportError(f"no file {location.absolute()}")
    spec = importlib.util.spec_from_file_location(f"reward_file_{location.stem}", location)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def absolute(path: str) -> str:
    """`path` with a reward file made absolute (the reward actor may run in
    another working directory); a module path as it is."""
    module_name, _, attr = path.partition(":")
    if module_name.endswith(".py"):
        return f"{Path(module_name).absolute()}:{attr}"
    return path


def openrlhf_adapter(reward_func: Callable) -> BatchReward:
    def batch(samples: list[RewardInput]) -> list[Any]:
        result = reward_func(
            [s.prompt + s.response for s in samples],
            [s.prompt for s in samples],
            [s.label for s in samples],
        )
        if isinstance(result, dict):
            if "rewards" not in result:
                raise RewardError(f"reward returned a dict without 'rewards': {sorted(result)}")
            result = result["rewards"]
        return as_list(result)

    return batch


def verl_adapter(compute_score: Callable) -> BatchReward:
    def batch(samples: list[RewardInput]) -> list[Any]:
        scores = []
        for s in samples:
            try:
                score = compute_score(
                    data_source=s.metadata.get("data_source"),
                    solution_str=s.response,
                    ground_truth=s.label,
                    extra_info=s.metadata.get("extra_info"),
                )
            except Exception as exc:
                raise RewardError(
                    f"reward raised on {s.name}: {type(exc).__name__}: {exc}"
                ) from exc
            scores.append(score["score"] if isinstance(score, dict) else score)
        return scores

    return batch


def as_list(values: Any) -> list[Any]:
    """A tensor, an array or a sequence, as a list."""
    tolist = getattr(values, "tolist", None)
    return tolist() if callable(tolist) else list(values)


def score(reward: BatchReward, samples: list[RewardInput], name: str = "reward") -> list[float]:
    """`reward` on `samples`, checked: one finite number per sample."""
    try:
        values = as_list(reward(samples))
    except RewardError:
        raise
    except Exception as exc:
        ids = ", ".join(s.name for s in samples[:3]) + (", ..." if len(samples) > 3 else "")
        raise RewardError(
            f"{name} raised on a batch of {len(samples)} samples ({ids}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if len(values) != len(samples):
        raise RewardError(f"{name} returned {len(values)} values for {len(samples)} samples")
    rewards = []
    for sample, value in zip(samples, values, strict=True):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise RewardError(f"{name} gave {value!r} for {sample.name}: not a finite number")
        rewards.append(number)
    return rewards


#: The toy task's target: lowercase ASCII letters (26 of the tiny model's 320
#: token ids, so a random policy scores about 0.08 and there is room to learn).
TARGET_CHARS = frozenset(string.ascii_lowercase)


def target_chars_fraction(samples: list[RewardInput]) -> list[float]:
    """Per sample, the fraction of generated tokens that are lowercase letters
    (the byte-level tokenizer makes each ASCII character one token). Empty
    completions score 0."""
    return [
        min(1.0, sum(ch in TARGET_CHARS for ch in s.response) / len(s.response_token_ids))
        if s.response_token_ids
        else 0.0
        for s in samples
    ]


class RewardTimeoutError(RewardError):
    """A batch's reward did not answer within its deadline."""


class RewardScorer:
    """Scores batches in Ray, not in the flow's process: a slow verifier (a
    sandbox, a remote judge) holds this actor, not the flow. One per run, so
    the reward's module is imported once (a Ray task would pay a worker's
    start-up per shard on a busy cluster, whose idle workers Ray reaps)."""

    def __init__(self, path: str, style: str):
        self.name = f"reward {path}"
        self.reward = load_reward(path, style)

    def score(self, samples: list[RewardInput]) -> list[float]:
        return score(self.reward, samples, self.name)


def start_reward_scorer(
    path: str, style: str, *, name: str | None = None, namespace: str | None = None
):
    """`RewardScorer` as a Ray actor. It asks for no CPU: a local cluster is
    sized for the engines and the policy, and a scorer waiting for a free CPU
    would wait for ever."""
    import ray

    options: dict[str, Any] = dict(num_cpus=0, max_restarts=0)
    if name is not None:
        options.update(name=name, namespace=namespace)
    return ray.remote(RewardScorer).options(**options).remote(path, style)


def score_remote(scorer: Any, samples: list[RewardInput], timeout_s: float) -> list[float]:
    """`scorer.score(samples)` with a deadline; the scorer's errors as raised."""
    import ray

    try:
        return ray.get(scorer.score.remote(samples), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RewardTimeoutError(
            f"the reward gave no answer within {timeout_s}s for a batch of "
            f"{len(samples)} samples (first {samples[0].name})"
        ) from None
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ValueError):  # RewardError, or a bad reward path
            raise exc.cause from None
        raise
