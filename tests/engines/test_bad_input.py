"""Bad input: a clear error naming the bad value, and nothing left behind."""

from __future__ import annotations

import pytest
import ray

from engines import BackendUnavailableError, EngineSpecError, create_vllm_engines

PREFIX = "test-bad"


def leftovers() -> tuple[list, list]:
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if PREFIX in a["name"]]
    groups = [
        info
        for info in ray.util.placement_group_table().values()
        if PREFIX in info["name"] and info["state"] != "REMOVED"
    ]
    return actors, groups


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_engines": 0}, "num_engines must be an integer >= 1, got 0"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
        (
            {"gpu_memory_utilization": 0.0},
            r"gpu_memory_utilization must be in \(0, 1\] or None .*, got 0.0",
        ),
        (
            {"gpu_memory_utilization": 1.5},
            r"gpu_memory_utilization must be in \(0, 1\] or None .*, got 1.5",
        ),
        ({"pretrain": "/nonexistent/model"}, "pretrain='/nonexistent/model' does not exist"),
        ({"max_len": 1}, "max_len must be an integer >= 2, got 1"),
        ({"backend": "tpu"}, "backend must be one of .* got 'tpu'"),
        ({"max_len": None}, r"max_len \(OpenRLHF: max_model_len\) is required"),
        # OpenRLHF's keyword names (create_vllm_engines, v0.11.2)
        ({"max_model_len": 256}, "max_len=128 and max_model_len=256 name the same limit"),
        ({"agent_func_path": "agent.py"}, "agent_func_path='agent.py' does not exist"),
        ({"remote_rm_url": "http://rm:5000"}, "remote_rm_url='http://rm:5000' is not supported"),
        ({"max_images_per_prompt": 2}, "max_images_per_prompt=2 is not supported"),
        ({"vllm_enable_sleep": True, "enable_sleep_mode": False}, "contradict each other"),
        # engine arguments that collide with ours, or that the CPU backend refuses
        ({"model": "other"}, "engine argument model='other' is set by create_vllm_engines"),
        ({"worker_extension_cls": "my.Ext"}, "worker_extension_cls='my.Ext' is set by"),
        ({"dtype": "int8"}, "dtype='int8' is not one of"),
        ({"logprobs_mode": "raw_logits"}, "logprobs_mode='raw_logits' is not supported by"),
        # 8 logical CPUs in the test cluster, no GPU: 5 x 2 bundles do not fit.
        ({"num_engines": 5, "tensor_parallel_size": 2}, "needs 10 CPUs, but the cluster has 8"),
    ],
)
def test_bad_spec_is_rejected_before_anything_exists(ray_local, tiny_model, change, message):
    spec = dict(
        num_engines=1,
        pretrain=tiny_model,
        max_len=128,
        gpu_memory_utilization=0.5,
        name_prefix=PREFIX,
    )
    spec.update(change)
    with pytest.raises(EngineSpecError, match=message):
        create_vllm_engines(**spec)
    assert leftovers() == ([], [])


def test_model_dir_without_config(ray_local, tmp_path):
    with pytest.raises(EngineSpecError, match="has no config.json"):
        create_vllm_engines(1, str(tmp_path), 128, 0.5, name_prefix=PREFIX)
    assert leftovers() == ([], [])


def test_vllm_backend_without_gpu_or_vllm(ray_local, tiny_model):
    with pytest.raises(BackendUnavailableError, match="backend='vllm'"):
        create_vllm_engines(1, tiny_model, 128, 0.5, backend="vllm", name_prefix=PREFIX)
    assert leftovers() == ([], [])


def test_name_collision_is_rejected(ray_local, tiny_model):
    from engines import destroy_engines

    engines = create_vllm_engines(1, tiny_model, 128, 0.5, name_prefix=PREFIX)
    try:
        with pytest.raises(EngineSpecError, match="already exist"):
            create_vllm_engines(1, tiny_model, 128, 0.5, name_prefix=PREFIX)
    finally:
        destroy_engines(engines)
    assert leftovers() == ([], [])


def test_unknown_engine_argument_is_named(ray_local, tiny_model, monkeypatch):
    """With vLLM importable, engine arguments are checked against its
    AsyncEngineArgs fields (here a stand-in list: CI has no vLLM)."""
    from engines.lifecycle import spec

    monkeypatch.setattr(spec, "vllm_engine_fields", lambda: frozenset({"enforce_eager", "dtype"}))
    with pytest.raises(EngineSpecError, match=r"unknown engine arguments \['enforce_eagre'\]"):
        create_vllm_engines(1, tiny_model, 128, 0.5, name_prefix=PREFIX, enforce_eagre=True)
    assert leftovers() == ([], [])
