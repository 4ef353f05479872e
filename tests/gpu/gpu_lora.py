"""The LoRA pieces of the GPU suite: a model of Qwen2-0.5B's decoder shape,
a trainer of a rank-16 adapter on it (the reference policy with LoRA, in
bf16), one vLLM engine with LoRA on the trainer's GPU, and adapter-only
syncs each followed by logprob parity (test_gpu_lora.py; the LoRA row of
the weight-format matrix through `gpu_helpers.lora_matrix_row`)."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_helpers import (
    PARITY_SEQUENCES,
    colocated,
    engine_prompt_logprobs,
    gpu_used_mib,
    logprob_distance,
)
from gpu_trainer import BF16Policy, ship_by_value

from engines.weight_sync.lora.sender import LOAD_PARTS

TIMEOUT_S = 180
RANK = 16
#: Scaling alpha / rank = 8: a change of the adapter by noise of std 0.01
#: (the matrix's) moves the model about as much as the same noise on every
#: weight does, so a missed sync is far outside the parity bound.
ALPHA = 128.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Adapter versions each engine keeps (the policy's max_staleness + 1): the
#: engine's max_loras must hold them.
KEEP = 2


def write_qwen2_half_b(path: Path) -> str:
    """A random Qwen2 with Qwen2-0.5B's decoder (24 layers, hidden 896, MLP
    4864, 14 heads, 2 KV heads), so its rank-16 adapter is that model's
    (8.8M parameters over 168 modules); the byte-level vocabulary keeps it
    small otherwise."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engines.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=320,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


class LoraPolicy(BF16Policy):
    """The reference policy training a LoRA adapter, in bf16."""

    def perturb(self, scale: float, seed: int = 0) -> int:
        """The first adapter plus fresh seeded noise (the base stays frozen); a
        new version. Fresh, not added to the last version's: added noise
        grows the adapter's product with every sync, and the matrix's later
        cells (one engine and trainer for the row) were tested ever further
        from the base, where bf16 rounding grows (H200, 2026-12-03: max
        0.03-0.08 at versions 1-5, 0.13-0.21 at versions 8-14)."""
        import torch

        generator = torch.Generator(device="cpu").manual_seed(seed)
        trained = [p for _, p in self.model.named_parameters() if p.requires_grad]
        if not hasattr(self, "_first_adapter"):
            self._first_adapter = [p.detach().clone() for p in trained]
        with torch.no_grad():
            for p, first in zip(trained, self._first_adapter, strict=True):
                noise = torch.randn(p.shape, generator=generator)
                p.copy_(first + (noise * scale).to(p.device, p.dtype))
        self.weight_version += 1
        return self.weight_version

    def ray_round_trips_ms(self, engine: Any, calls: int) -> list[float]:
        """Milliseconds of `calls` calls to the engine actor that do nothing
        (`base_health`), from here: what a sync's two Ray hops cost at least."""
        import ray

        seconds = []
        for _ in range(calls):
            started = time.monotonic()
            ray.get(engine.base_health.remote(), timeout=TIMEOUT_S)
            seconds.append((time.monotonic() - started) * 1e3)
        return seconds

    def sync_adapter_with_vllm_api(self, engines: list[Any]) -> float:
        """Sync the adapter as a trainer written to vLLM 0.26's docs does (its
        client and IPC trainer code); its API carries tensors only, so lora_B
        goes scaled by alpha / rank (the engine takes scaling 1). Seconds."""
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

        started = time.monotonic()
        scale = self.lora.spec.alpha / self.lora.spec.rank
        weights = [(n, t * scale if ".lora_B." in n else t) for n, t in self.named_weights()]
        client = RayVLLMWeightSyncClient(list(engines))
        client.init_weight_transfer_engine({})
        client.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(
            iter(weights), {"send_mode": "ray", "llm_handle": list(engines), "packed": False}
        )
        client.finish_weight_update()
        return time.monotonic() - started


def start_lora_policy(pretrain: str, **options: Any):
    import ray

    from training.config import PolicyConfig

    ship_by_value(sys.modules[__name__])
    config = PolicyConfig(
        pretrain=pretrain,
        device="cuda",
        sync_timeout_s=120.0,
        lora_rank=RANK,
        lora_alpha=ALPHA,
        lora_target_modules=TARGETS,
        max_staleness=KEEP - 1,
    )
    return ray.remote(LoraPolicy).options(max_restarts=0, **options).remote(config.model_dump())


def lora_engine_and_policy(
    model: str, baseline_mib: list[int]
) -> contextlib.AbstractContextManager[tuple[list, Any]]:
    """One vLLM engine with LoRA and the LoRA policy, sharing one GPU."""
    return colocated(
        model,
        baseline_mib,
        start_lora_policy,
        "gpu-lora",
        "1 engine with LoRA colocated with the trainer",
        enable_lora=True,
        max_lora_rank=RANK,
        max_loras=KEEP,
    )


@dataclass(frozen=True)
class AdapterSync:
    """One adapter-only sync: parity after it (max, mean |engine - trainer|),
    the mean distance a missed sync would show (the trainer before against
    after the change), the trainer's seconds for the sync (`SyncReport`;
    over vLLM's API, its client's calls), the report (None over vLLM's API)
    and the version the engine serves after it."""

    max_abs: float
    mean_abs: float
    stale_mean_abs: float
    seconds: float
    report: Any = field(repr=False)  # SyncReport | None
    served: int


def breakdown_ms(report: Any) -> dict[str, float]:
    """Where a CUDA IPC adapter sync's milliseconds went: packing on the
    trainer, the call's way to the engine actor and on to its worker, the
    worker's load (the copy queued; its parts: `lora.sender.LOAD_PARTS`),
    the answer's way back to the actor (through vLLM's engine core), the
    actor's commit, and Ray's way back to the trainer. Moments are offsets
    into the sync (`Phases.engines_reported`)."""
    times, pack = report.engine_times, report.phases["pack"]
    parts = {
        "total": report.seconds,
        "pack": pack,
        "to_actor": times["actor_in_at"] - pack,
        "to_worker": times["worker_in_at"] - times["actor_in_at"],
        "load": times["load_s"],
        "to_actor_back": times["received_at"] - times["queued_at"],
        "commit": times["actor_out_at"] - times["received_at"],
        "ray_back": report.seconds - times["actor_out_at"],
    }
    parts.update((k.removesuffix("_s"), times[k]) for k in LOAD_PARTS if k in times)
    return {k: round(v * 1e3, 3) for k, v in parts.items()}


def adapter_syncs(engines, policy, transport: str, syncs: int, perturb: float, directory: str):
    """`syncs` syncs over `transport`, each of an adapter changed by `perturb`."""
    import ray

    if transport != "vllm_native":
        options = {"checkpoint_dir": directory} if transport == "checkpoint" else {}
        init = policy.init_weight_sync.remote(engines, transport=transport, **options)
        ray.get(init, timeout=TIMEOUT_S)
    engine = engines[0]
    before = ray.get(policy.sequence_logprobs.remote(PARITY_SEQUENCES), timeout=TIMEOUT_S)
    done = []
    for _ in range(syncs):
        version = ray.get(engine.health.remote(), timeout=TIMEOUT_S)["weight_version"] + 1
        ray.get(policy.perturb.remote(perturb, seed=version), timeout=TIMEOUT_S)
        policy_version = ray.get(policy.health.remote(), timeout=TIMEOUT_S)["weight_version"]
        after = ray.get(policy.sequence_logprobs.remote(PARITY_SEQUENCES), timeout=TIMEOUT_S)
        if transport == "vllm_native":
            report = None
            sync = policy.sync_adapter_with_vllm_api.remote(engines)
            seconds = ray.get(sync, timeout=TIMEOUT_S)
        else:
            report = ray.get(policy.sync_weights.remote(), timeout=TIMEOUT_S)
            seconds = report.seconds
        worst, mean = logprob_distance(engine_prompt_logprobs(engine, TIMEOUT_S), after)
        _, stale = logprob_distance(before, after)
        served = ray.get(engine.health.remote(), timeout=TIMEOUT_S)["weight_version"]
        assert served == policy_version == version, (served, policy_version, version)
        done.append(AdapterSync(worst, mean, stale, seconds, report, served))
        before = after
    return done


def matrix_row(transports, syncs: int, perturb: float, directory: str | Path) -> dict[str, list]:
    """The weight-format matrix's LoRA row (`gpu_helpers.lora_matrix_row`)."""
    baseline = gpu_used_mib()
    model = write_qwen2_half_b(Path(directory) / "qwen2-0.5b-shaped")
    results: dict[str, list] = {}
    started = time.monotonic()
    with lora_engine_and_policy(model, baseline) as (engines, policy):
        for transport in transports:
            where = str(Path(directory) / transport)
            results[transport] = adapter_syncs(engines, policy, transport, syncs, perturb, where)
    print(f"LoRA row: {time.monotonic() - started:.0f}s")
    return results
