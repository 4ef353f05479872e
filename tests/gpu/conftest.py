"""Fixtures of the GPU suite: real vLLM engines on CUDA (see README.md here).

Every test here is skipped, not errored, where CUDA or vLLM is missing, so
`pytest -m gpu tests/gpu` on a CPU machine reports skips.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
from gpu_helpers import MODEL_SHAPE, gpu_used_mib


def missing_requirement() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install 'rolloutflow[vllm]')"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


@pytest.fixture(scope="session", autouse=True)
def _needs_gpu():
    """Session-scoped, so it runs before any other session fixture (the model
    build, Ray): a CPU machine skips without doing that work."""
    reason = missing_requirement()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def gpu_count(_needs_gpu) -> int:
    import torch

    return torch.cuda.device_count()


@pytest.fixture(scope="session")
def gpu_model(_needs_gpu, tmp_path_factory) -> str:
    from engines.tiny_model import build_tiny_model

    start = time.monotonic()
    path = build_tiny_model(tmp_path_factory.mktemp("model") / "llama-0.28b", **MODEL_SHAPE)
    print(f"\nbuilt the GPU model at {path} in {time.monotonic() - start:.1f}s")
    return str(path)


@pytest.fixture(scope="session")
def ray_gpu(_needs_gpu):
    """One local Ray cluster over all GPUs of the host (the root conftest shuts
    it down at the end of the session; never `ray stop`)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=max(8, os.cpu_count() or 8),
            include_dashboard=False,
            namespace="rolloutflow-gpu-tests",
        )
    return ray


@pytest.fixture(scope="session")
def hf_reference(gpu_model):
    """The same weights in transformers on the last GPU, for logprob parity."""
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    model = AutoModelForCausalLM.from_pretrained(gpu_model, dtype=torch.bfloat16).to(device)
    return model.eval()


@pytest.fixture(scope="session")
def gpu_baseline(hf_reference) -> list[int]:
    """MiB in use per GPU before any engine starts (the reference model included)."""
    return gpu_used_mib()
