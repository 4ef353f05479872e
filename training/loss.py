"""A micro-batch's loss from its rollout samples: the padded tensors of
which tokens count and what the engine's logprobs were, built on the CPU
and sent in one copy each, then the clipped loss of every sample at once
(`training.grpo`'s math), and the off-policy sums kept on the device. Nothing
here reads a value back from the GPU: a read per sample waited for the GPU
every time, so the CPU could never queue the step ahead of it."""

from __future__ import annotations

from typing import Any

from training.grpo import clipped_loss, k3_kl, truncated_is_weights
from training.rollouts import RolloutSample


class OffPolicyStats:
    """Per-token sums over a step's sampled tokens with behaviour logprobs:
    the train/inference mismatch and the importance weights. Kept on the
    policy's device and read once, in `report`."""

    #: The sums, in the order `add` stacks them.
    NAMES = ("tokens", "abs_diff", "kl", "weights", "truncated")

    def __init__(self) -> None:
        self.sums: Any = None

    def add(self, proximal: Any, behaviour: Any, weight: Any, cap: float, mask: Any) -> None:
        """Elementwise tensors of one shape; `mask`: the tokens counted."""
        import torch

        def total(values: Any) -> Any:
            return torch.where(mask, values, 0.0).sum()

        sums = torch.stack(
            [
                mask.sum().float(),
                total((proximal - behaviour).abs()),
                total(k3_kl(proximal, behaviour)),
                total(weight),
                total((weight >= cap).float()),
            ]
        )
        self.sums = sums if self.sums is None else self.sums + sums

    def report(self) -> dict[str, float]:
        if self.sums is None:
            return {}
        sums = dict(zip(self.NAMES, self.sums.tolist(), strict=True))
        tokens = sums["tokens"]
        if not tokens:
            return {}
        return {
            "logprob_mismatch": sums["abs_diff"] / tokens,
            "kl_k3": sums["kl"] / tokens,
            "is_weight_mean": sums["weights"] / tokens,
            "is_truncated_fraction": sums["truncated"] / tokens,
        }


def micro_batch_loss(
    trained: list[tuple[RolloutSample, float]],
    logprobs: Any,
    *,
    clip_eps: float,
    tis_cap: float,
    off_policy: OffPolicyStats,
) -> Any:
    """Each sample's clipped loss (one per row of `logprobs`, the micro-batch's
    padded `token_logprobs`) over its sampled tokens only: the response
    stream's environment and template tokens (loss mask 0) are context for
    the forward, with no loss, no importance weight and no share of the
    mean. Rows with behaviour logprobs weight each token's term by
    min(pi_proximal / pi_behaviour, tis_cap) (decoupled PPO, the ratio taken
    against the policy's own logprobs before the step); rows without, by 1."""
    import torch

    rows, width = logprobs.shape
    keep = torch.zeros((rows, width), dtype=torch.bool)
    behaviour = torch.zeros((rows, width))
    has_behaviour = torch.zeros((rows, 1), dtype=torch.bool)
    advantages = torch.tensor([[advantage] for _, advantage in trained])
    for row, (sample, _) in enumerate(trained):
        # Position t predicts token t + 1: the completion's first token is
        # predicted at the prompt's last position.
        start = len(sample.prompt_token_ids) - 1
        end = start + len(sample.completion_token_ids)
        keep[row, start:end] = torch.tensor(sample.mask, dtype=torch.bool)
        if sample.logprobs is not None:
            behaviour[row, start:end] = torch.tensor(sample.logprobs)
            has_behaviour[row] = True
    device = logprobs.device
    keep, behaviour, has_behaviour, advantages = (
        _to_device(t, device) for t in (keep, behaviour, has_behaviour, advantages)
    )
    proximal = logprobs.detach()
    weight = torch.where(has_behaviour, truncated_is_weights(proximal, behaviour, tis_cap), 1.0)
    off_policy.add(proximal, behaviour, weight, tis_cap, keep & has_behaviour)
    return clipped_loss(logprobs, proximal, advantages, clip_eps, weight, keep)


def _to_device(tensor: Any, device: Any) -> Any:
    """A CPU tensor on `device` without waiting for the GPU: a copy from
    pageable memory waits for the work queued on the stream before it."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
