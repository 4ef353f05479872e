"""Test-only methods of a policy actor (moved out of training/policy.py):
read its weights and logprobs, and give the engines something new to sync.
`ProbedPolicy` is the reference policy with them; the GPU tests' trainer
(tests/gpu/gpu_trainer.py) mixes `PolicyProbes` in too."""

from __future__ import annotations

import sys
from typing import Any

from training.grpo import token_logprobs
from training.policy import ReferencePolicy
from training.policy_actor import create_policy_actor


class PolicyProbes:
    """For a `ReferencePolicy` (its `model`, `pad_id`, `weight_version`)."""

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of tokens 1..n-1 of each sequence (the engines' prompt_logprobs)."""
        import torch

        with torch.no_grad():
            rows = token_logprobs(self.model, sequences, self.pad_id)
        return [row[: len(seq) - 1].tolist() for row, seq in zip(rows, sequences, strict=True)]

    def read_weights(self, names: list[str]) -> dict[str, Any]:
        params = dict(self.model.named_parameters())
        return {n: params[n].detach().to("cpu", copy=True) for n in names}

    def perturb(self, scale: float, seed: int = 0) -> int:
        """Add seeded noise to every weight and bump the version: a cheap way to
        give the engines something new to sync (tests, benchmarks)."""
        import torch

        generator = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for _, p in self.model.named_parameters():
                noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
                p.add_(noise.to(p.device) * scale)
        self.weight_version += 1
        return self.weight_version


class ProbedPolicy(PolicyProbes, ReferencePolicy):
    pass


def create_probed_policy(config: Any, **options: Any):
    """`create_policy_actor` with `ProbedPolicy`."""
    import ray

    # Ray pickles classes by reference and its workers cannot import tests/:
    # ship this module's code by value instead.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return create_policy_actor(config, policy_class=ProbedPolicy, **options)
