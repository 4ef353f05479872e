"""Weight sync into real vLLM engines for every architecture of the matrix
(tests/architectures.py: Llama 3, Qwen2 tied, Qwen3, Mistral, Gemma 2,
Qwen2-MoE, Qwen3-MoE), on one GPU: the trainer colocated with the engine, syncing by our
CUDA IPC (twice: the second replays, for proven classes), by vLLM's own
client and IPC trainer code (`vllm_native`), and by a checkpoint directory.
After each sync the engine's logprobs match the trainer's within the bound
stated per model; loads replay the copy plan only for the classes proven
equal to vLLM's loader (`worker.REPLAY_PROVEN`), and go through vLLM's
layerwise reload otherwise. The MoE models sync the trainer's fused experts
(transformers 5) into an engine started from a per-expert checkpoint
(engines/weight_sync/formats/moe.py).

    pytest -m gpu tests/gpu/test_gpu_architectures.py -s
"""

from __future__ import annotations

import pytest
from architectures import ARCHITECTURES, VLLM_CLASSES, write
from gpu_helpers import (
    PARITY_SEQUENCES,
    colocated,
    engine_prompt_logprobs,
    logprob_distance,
)
from gpu_trainer import start_bf16_policy

from engines.weight_sync.worker import REPLAY_PROVEN

pytestmark = pytest.mark.gpu

TIMEOUT_S = 180
#: bf16 parity of engine and trainer (max, mean |diff| of per-token logprobs)
#: per architecture: the bound of the 0.28B Llama (test_gpu_weight_sync.py)
#: until these models are measured on the H200s.
BOUNDS = {arch: (0.2, 0.06) for arch in ARCHITECTURES}
SHAPE = dict(hidden=256, layers=2)


def check_parity(ray, arch, engine, policy, what: str) -> None:
    ours = engine_prompt_logprobs(engine, TIMEOUT_S)
    trainer = ray.get(policy.sequence_logprobs.remote(PARITY_SEQUENCES), timeout=TIMEOUT_S)
    worst, mean = logprob_distance(ours, trainer)
    print(f"{arch} {what}: max |diff| {worst:.4f}, mean {mean:.4f}")
    max_bound, mean_bound = BOUNDS[arch]
    assert worst < max_bound and mean < mean_bound, (worst, mean)


def check_plan(ray, arch, engine) -> None:
    (plan,) = ray.get(engine.collective_rpc.remote("copy_plan_status"), timeout=TIMEOUT_S)
    print(f"{arch} copy plan: {plan}")
    if (VLLM_CLASSES[arch], None) in REPLAY_PROVEN:
        assert plan["refused"] is None and plan["copies"] > 0, plan
    else:
        assert "not proven" in plan["refused"], plan


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_transport_into_every_architecture(arch, ray_gpu, gpu_baseline, tmp_path_factory):
    ray = ray_gpu
    model = str(write(arch, tmp_path_factory.mktemp(arch) / "model", **SHAPE))
    with colocated(
        model,
        gpu_baseline,
        start_bf16_policy,
        f"gpu-arch-{arch}",
        f"{arch}: 1 engine colocated with the trainer",
    ) as (engines, policy):
        engine = engines[0]
        check_parity(ray, arch, engine, policy, "before any sync")
        ray.get(policy.init_weight_sync.remote(engines, transport="cuda_ipc"), timeout=TIMEOUT_S)
        for seed in (1, 2):
            ray.get(policy.perturb.remote(0.02, seed), timeout=TIMEOUT_S)
            report = ray.get(policy.sync_weights.remote(), timeout=TIMEOUT_S)
            print(f"{arch} CUDA IPC sync {seed}: {report}")
            check_parity(ray, arch, engine, policy, f"after CUDA IPC sync {seed}")
            check_plan(ray, arch, engine)
        # vLLM's own trainer code and client, through our engine actor.
        version = ray.get(engine.health.remote(), timeout=TIMEOUT_S)["weight_version"]
        ray.get(policy.perturb.remote(0.02, 3), timeout=TIMEOUT_S)
        ray.get(policy.sync_with_vllm_api.remote(engines), timeout=TIMEOUT_S)
        health = ray.get(engine.health.remote(), timeout=TIMEOUT_S)
        assert health["weight_version"] == version + 1 and not health["stale"]
        check_parity(ray, arch, engine, policy, "after vLLM's native IPC sync")
        # A checkpoint directory.
        directory = str(tmp_path_factory.mktemp(f"{arch}-ckpt"))
        ray.get(
            policy.init_weight_sync.remote(
                engines, transport="checkpoint", checkpoint_dir=directory
            ),
            timeout=TIMEOUT_S,
        )
        ray.get(policy.perturb.remote(0.02, 4), timeout=TIMEOUT_S)
        report = ray.get(policy.sync_weights.remote(), timeout=TIMEOUT_S)
        assert report.verified, report
        check_parity(ray, arch, engine, policy, "after a checkpoint sync")
