"""Start-up timing of engines (engines/startup.py): the phases an engine
actor reports, and the compile-cache key engines of one set share."""

from __future__ import annotations

import ray

from engines import create_vllm_engines, destroy_engines, env
from engines.config import EngineConfig
from engines.lifecycle.actors import actor_env
from engines.lifecycle.placement import EnginePlacement
from engines.startup import Phase, StartupClock, StartupReport


def test_clock_phases_add_up_to_the_start():
    clock = StartupClock(began=100.0)
    clock.last = 100.0
    clock.mark("imports")
    clock.mark("model load")
    report = clock.report("e-0", "hf")
    assert [p.name for p in report.phases] == ["imports", "model load"]
    assert abs(sum(p.seconds for p in report.phases) - report.seconds) < 0.01


def test_cpu_engine_reports_its_start_up(ray_local, tiny_model):
    engines = create_vllm_engines(1, tiny_model, 128, name_prefix="test-startup", backend="hf")
    try:
        report = ray.get(engines[0].startup_report.remote(), timeout=120)
        assert isinstance(report, StartupReport)
        assert report.engine == "test-startup-0" and report.backend == "hf"
        assert [p.name for p in report.phases] == [
            "imports",
            "torch and transformers imports",  # in the actor only, not in the driver
            "tokenizer",
            "model load",
            "generation thread",
        ]
        assert all(isinstance(p, Phase) and p.seconds >= 0 for p in report.phases)
        assert report.phases[1].seconds > 0
        assert abs(sum(p.seconds for p in report.phases) - report.seconds) < 0.05
        assert report.vllm_phases == ()
    finally:
        destroy_engines(engines)


def test_tp2_engine_core_is_told_the_cluster(ray_local):
    """A TP>1 engine core forks from the actor's forkserver, not from vLLM's
    spawn that sets RAY_ADDRESS: the actor's environment must carry it."""
    config = EngineConfig(
        name="e-0",
        pretrain="m",
        max_len=64,
        seed=0,
        tensor_parallel_size=2,
        bundle_indices=[0, 1],
        rpc_timeout_s=5,
    )
    group = ray.util.placement_group([{"CPU": 0.01}, {"CPU": 0.01}])
    ray.get(group.ready(), timeout=60)
    try:
        placement = EnginePlacement(
            placement_group=group, bundles=[[0, 1]], uses_gpu=True, owns_group=True
        )
        variables = actor_env("vllm", placement, config)
        assert variables[env.RAY_ADDRESS] == ray.get_runtime_context().gcs_address
        tp1 = config.model_copy(update={"tensor_parallel_size": 1, "bundle_indices": [0]})
        assert env.RAY_ADDRESS not in actor_env("vllm", placement, tp1)
        # vLLM's threads as plain vLLM has them (every core of the node), not Ray's 1.
        assert variables["OMP_NUM_THREADS"] == str(int(ray.cluster_resources()["CPU"]))
    finally:
        ray.util.remove_placement_group(group)


def test_tp1_engines_share_one_compile_cache_key():
    """vLLM keys its torch.compile cache by every VLLM_* variable it knows:
    engines of a set (and spares on other bundles) must not differ in one."""
    first = env.actor_env_vars("vllm", [0], None, node_cpus=16)
    other = env.actor_env_vars("vllm", [3], None, node_cpus=16)
    assert first == other
    assert env.VLLM_RAY_BUNDLE_INDICES not in first
    # TP>1: vLLM's Ray executor needs its bundles.
    tp2 = env.actor_env_vars("vllm", [2, 3], None, node_cpus=16)
    assert tp2[env.VLLM_RAY_BUNDLE_INDICES] == "2,3"
