"""LoRA adapter-only sync into a real vLLM engine on the trainer's GPU: a
rank-16 adapter on a model of Qwen2-0.5B's decoder shape (gpu_lora.py), 6
syncs over CUDA IPC, each followed by logprob parity against the trainer
(peft, bf16) within the suite's synced bounds, and a check that the sync
moved the engine (a missed one is outside the bound). Prints each sync's
milliseconds (the trainer's `SyncReport.seconds`) and where they went; the
target is a median of at most 10 ms over syncs 2-6. Then
2 syncs over vLLM's native API (its own client and IPC trainer code) and 2
through a peft adapter directory, each with parity.

    pytest -m gpu tests/gpu/test_gpu_lora.py -s

With `LORA_SYNC_JSON=<path>` the CUDA IPC syncs' figures (each sync's
breakdown, `gpu_lora.breakdown_ms`, and the median) are written there too.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
from gpu_helpers import SYNCED_MAX_ABS, SYNCED_MEAN_ABS
from gpu_lora import (
    KEEP,
    TIMEOUT_S,
    adapter_syncs,
    breakdown_ms,
    lora_engine_and_policy,
    write_qwen2_half_b,
)

pytestmark = pytest.mark.gpu

#: The first maps the trainer's buffer; the median is of the 5 after it.
SYNCS = 6
PERTURB = 0.01
#: Issue 32: a rank-16 adapter on a 0.5B-shaped model in at most 10 ms over
#: CUDA IPC (the first sync also maps the trainer's buffer: the others count).
TARGET_S = 0.010


def test_lora_sync_over_cuda_ipc(ray_gpu, gpu_baseline, tmp_path_factory):
    ray = ray_gpu
    directory = tmp_path_factory.mktemp("lora")
    model = write_qwen2_half_b(directory / "model")
    with lora_engine_and_policy(model, gpu_baseline) as (engines, policy):
        syncs = adapter_syncs(engines, policy, "cuda_ipc", SYNCS, PERTURB, str(directory))
        breakdowns = [breakdown_ms(sync.report) for sync in syncs]
        for i, (sync, parts) in enumerate(zip(syncs, breakdowns, strict=True), 1):
            report = sync.report
            print(
                f"lora sync {i} (v{sync.served}): {sync.seconds * 1e3:.2f} ms, "
                f"{report.bytes / 1e6:.1f} MB; ms: {parts}; "
                f"parity max {sync.max_abs:.4f} / mean {sync.mean_abs:.4f}, "
                f"a missed sync {sync.stale_mean_abs:.4f}"
            )
            assert report.transport == "lora-cuda_ipc"
            assert sync.max_abs < SYNCED_MAX_ABS and sync.mean_abs < SYNCED_MEAN_ABS, sync
            assert sync.stale_mean_abs > SYNCED_MEAN_ABS, f"sync {i} moved the model too little"
        # max_staleness + 1 adapters stay loaded; older ones are gone.
        loaded = ray.get(engines[0].lora_adapters.remote(), timeout=TIMEOUT_S)
        assert loaded == [f"rolloutflow-v{s.served}" for s in syncs[-KEEP:]], loaded
        trips = ray.get(policy.ray_round_trips_ms.remote(engines[0], 20), timeout=TIMEOUT_S)
        print(
            f"a Ray call from the trainer to the engine actor and back, doing nothing: "
            f"median {statistics.median(trips):.2f} ms of 20 (min {min(trips):.2f})"
        )
        later = [s.seconds for s in syncs[1:]]
        median = statistics.median(later)
        print(
            f"lora sync over CUDA IPC: median {median * 1e3:.2f} ms of syncs 2-{SYNCS} "
            f"(first {syncs[0].seconds * 1e3:.2f} ms), target {TARGET_S * 1e3:.0f} ms"
        )
        if os.environ.get("LORA_SYNC_JSON"):
            figures = {
                "median_ms": median * 1e3,
                "ray_round_trip_ms": trips,
                "target_ms": TARGET_S * 1e3,
                "syncs": [
                    {"version": s.served, "max_abs": s.max_abs, "mean_abs": s.mean_abs, "ms": parts}
                    for s, parts in zip(syncs, breakdowns, strict=True)
                ],
            }
            Path(os.environ["LORA_SYNC_JSON"]).write_text(json.dumps(figures, indent=2))
        # The other ways on the same engine: vLLM's own client and IPC code,
        # a peft adapter directory.
        for transport in ("vllm_native", "checkpoint"):
            where = str(directory / transport)
            for i, sync in enumerate(adapter_syncs(engines, policy, transport, 2, PERTURB, where)):
                print(
                    f"lora {transport} sync {i + 1} (v{sync.served}): {sync.seconds * 1e3:.1f} ms; "
                    f"parity max {sync.max_abs:.4f} / mean {sync.mean_abs:.4f}, "
                    f"a missed sync {sync.stale_mean_abs:.4f}"
                )
                assert sync.max_abs < SYNCED_MAX_ABS and sync.mean_abs < SYNCED_MEAN_ABS, sync
                assert sync.stale_mean_abs > SYNCED_MEAN_ABS, sync
        assert median <= TARGET_S, f"median {median * 1e3:.2f} ms is above the target"
