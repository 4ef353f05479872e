"""The vLLM backend's sleep and wake-up on a shared GPU, an adopted engine's
wait for its GPU's memory, and its sync probe (engines/vllm/engine.py,
control.py), with a stand-in for vLLM's AsyncLLM: CI has no vLLM."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from types import SimpleNamespace

import pytest
from fresh_imports import imported_with

from engines.config import EngineConfig
from engines.vllm import VLLMEngine
from engines.vllm import control as vllm_control
from engines.vllm import engine as vllm_engine
from engines.vllm.args import WORKER_EXTENSION, engine_args
from engines.vllm.core import CoreCalls


@pytest.fixture
def engine() -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM to start
    engine.config = SimpleNamespace(name="e0", rpc_timeout_s=5.0)
    engine.engine = SimpleNamespace(errored=False)
    engine._core = CoreCalls(engine.engine, "e0")
    return engine


def gpu_readings(engine, monkeypatch, used: list[int], total: int = 100) -> list[int]:
    """The engine's GPU memory as `worker_memory` reports it: the next of
    `used` per call (the last one from then on); returns the readings taken."""
    taken: list[int] = []

    async def rpc(method, *args, **kwargs):
        taken.append(used[min(len(taken), len(used) - 1)])
        return [{"gpu_uuid": "GPU-a", "used_bytes": taken[-1], "total_bytes": total}]

    async def sleep(level, mode):
        pass

    monkeypatch.setattr(engine, "_rpc", rpc)
    monkeypatch.setattr(vllm_control, "ROOM_POLL_S", 0.0)
    engine.sleep_mode = True
    engine._slept_bytes = {}
    engine.engine.sleep = sleep
    return taken


def test_a_spare_wakes_once_its_gpu_has_the_room_its_sleep_freed(engine, monkeypatch):
    # Asleep it frees 40 (60 -> 20); then an engine beside it dies and its
    # memory goes in steps: free 30, 35, then 60 >= 40.
    taken = gpu_readings(engine, monkeypatch, [60, 20, 70, 65, 40, 10])

    async def main():
        await engine.sleep(1)
        await engine.wait_gpu_room(timeout_s=5)

    asyncio.run(main())
    assert taken == [60, 20, 70, 65, 40]  # it looked until the room was there, and no longer


def test_waiting_for_room_ends_at_its_deadline(engine, monkeypatch):
    gpu_readings(engine, monkeypatch, [60, 20, 95])

    async def main():
        await engine.sleep(1)
        return await engine.wait_gpu_room(timeout_s=0.2)

    assert 0.2 <= asyncio.run(main()) < 2


def device_readings(monkeypatch, free: list[int], total: int = 100) -> list[str]:
    """The GPU's free memory as NVML reports it (`device_memory`): the next of
    `free` per call, the last from then on; returns the devices asked for."""
    asked: list[str] = []

    def device_memory(device: str) -> tuple[int, int]:
        asked.append(device)
        return free[min(len(asked), len(free)) - 1], total

    monkeypatch.setattr(vllm_control, "device_memory", device_memory)
    monkeypatch.setattr(vllm_control, "ROOM_POLL_S", 0.0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    return asked


def test_an_adopted_engine_starts_once_the_lost_ones_memory_is_freed(engine, monkeypatch):
    # It asks for 0.3 of the GPU: 30; the lost engine's memory goes in steps.
    asked = device_readings(monkeypatch, [5, 20, 29, 30, 80])
    config = EngineConfig(
        name="e0", seed=0, rpc_timeout_s=5, pretrain="m", max_len=8, gpu_memory_utilization=0.3
    )
    asyncio.run(engine._await_room(config, timeout_s=5))
    assert asked == ["3"] * 4  # Ray's device, until the room was there, and no longer


def test_an_adopted_engine_asks_vllms_default_share_and_stops_at_its_deadline(engine, monkeypatch):
    asked = device_readings(monkeypatch, [89])  # vLLM's default asks for 90
    config = EngineConfig(name="e0", seed=0, rpc_timeout_s=5, pretrain="m", max_len=8)
    began = time.monotonic()
    asyncio.run(engine._await_room(config, timeout_s=0.2))
    assert 0.2 <= time.monotonic() - began < 2 and len(asked) > 1


def test_no_test_folder_passes_for_vllm():
    """pytest puts test folders on sys.path (tests/engines for the tests in
    it): a folder named `vllm` in one, this folder's natural name, passes for
    vLLM as a namespace package on a machine without vLLM, and the driver
    then takes vLLM for installed."""
    spec = importlib.util.find_spec("vllm")
    assert spec is None or spec.origin is not None


def test_importing_the_backend_leaves_vllm_to_the_actor():
    """The driver creates the actor from `engines.vllm`, on a CPU machine too;
    vLLM (and torch) are imported by the actor, as it starts."""
    assert imported_with("engines.vllm") == []


def test_engine_args_are_the_configs_then_the_callers():
    api = SimpleNamespace(vllm=SimpleNamespace(AsyncEngineArgs=lambda **kw: SimpleNamespace(**kw)))
    config = EngineConfig(
        name="e-0",
        pretrain="m",
        max_len=64,
        seed=3,
        gpu_memory_utilization=0.5,
        tensor_parallel_size=2,
        rpc_timeout_s=5,
        engine_kwargs={"disable_log_stats": False, "enforce_eager": True},
    )
    args = engine_args(api, config)
    assert (args.model, args.max_model_len, args.seed, args.tensor_parallel_size) == ("m", 64, 3, 2)
    assert args.distributed_executor_backend == "ray"  # TP>1: vLLM's Ray executor
    assert args.gpu_memory_utilization == 0.5 and args.worker_extension_cls == WORKER_EXTENSION
    assert args.disable_log_stats is False and args.enforce_eager is True  # the caller's
    one_gpu = engine_args(api, config.model_copy(update={"tensor_parallel_size": 1}))
    assert one_gpu.distributed_executor_backend == "uni"
    quiet = engine_args(api, config.model_copy(update={"engine_kwargs": {}}))
    assert quiet.disable_log_stats is True
    assert not hasattr(args, "quantization")  # None: vLLM reads the checkpoint's
    fp8 = engine_args(api, config.model_copy(update={"quantization": "fp8"}))
    assert fp8.quantization == "fp8"


def test_quantization_is_fp8_or_none_and_never_an_engine_argument_too():
    from engines.errors import EngineSpecError
    from engines.lifecycle.spec import EngineSetSpec

    settings = dict(name="e-0", pretrain="m", max_len=64, seed=3, rpc_timeout_s=5)
    with pytest.raises(EngineSpecError, match="quantization='awq'"):
        EngineConfig(**settings, quantization="awq")
    with pytest.raises(EngineSpecError, match="pass it as create_vllm_engines' quantization="):
        EngineSetSpec(
            num_engines=1, pretrain="org/model", max_len=64, engine_kwargs={"quantization": "fp8"}
        )


def test_a_lora_engine_asks_vllm_for_lora_of_its_rank():
    api = SimpleNamespace(vllm=SimpleNamespace(AsyncEngineArgs=lambda **kw: SimpleNamespace(**kw)))
    config = EngineConfig(
        name="e-0", pretrain="m", max_len=64, seed=3, rpc_timeout_s=5, engine_kwargs={}
    )
    assert not hasattr(engine_args(api, config), "enable_lora")  # vLLM's default: off
    lora = config.model_copy(
        update={"enable_lora": True, "max_lora_rank": 32, "engine_kwargs": {"max_loras": 2}}
    )
    args = engine_args(api, lora)
    assert (args.enable_lora, args.max_lora_rank, args.max_loras) == (True, 32, 2)
    assert args.max_cpu_loras == 3  # the served adapter stays while the next loads


def probing(engine, monkeypatch, one) -> None:
    """`engine` awake and open, its probe request answered by `one(prompt, params)`."""
    from engines.admission import Admission

    class Params(SimpleNamespace):
        output_kind = None

    api = SimpleNamespace(
        vllm=SimpleNamespace(SamplingParams=Params),
        RequestOutputKind=SimpleNamespace(FINAL_ONLY="final"),
    )
    monkeypatch.setattr(vllm_engine, "vllm_api", lambda: api)
    monkeypatch.setattr(engine, "_one", one)
    engine._asleep = set()
    engine._admission = Admission(freeze=None, thaw=None, abort=None, version=lambda: 0)


def test_the_probe_reads_each_prompt_tokens_logprob_from_one_request(engine, monkeypatch):
    from engines.outputs import Logprob, RequestOutput

    sent = []

    async def one(prompt, params):
        sent.append((prompt, params))
        # vLLM's prompt logprobs: none for the first token, then the token's own.
        rows = [None] + [{t: Logprob(-0.5 * t), 99: Logprob(-9.0)} for t in prompt[1:]]
        return RequestOutput("r", prompt, [], 0, "e0", prompt_logprobs=rows)

    probing(engine, monkeypatch, one)
    assert asyncio.run(engine.probe_logprobs([3, 4, 6])) == [-2.0, -3.0]
    ((_, params),) = sent
    assert params.max_tokens == 1 and params.prompt_logprobs == 0 and params.temperature == 0.0
    assert params.output_kind == "final"
    # Asleep (no KV cache), or with requests frozen inside vLLM (which
    # schedules nothing new until resumed): no probe, and no request sent.
    engine._asleep = {"kv_cache"}
    assert asyncio.run(engine.probe_logprobs([3, 4, 6])) is None
    engine._asleep = set()
    engine._admission._frozen = True
    assert asyncio.run(engine.probe_logprobs([3, 4, 6])) is None
    assert len(sent) == 1


def test_a_probe_aborted_before_its_prefill_is_skipped(engine, monkeypatch):
    """A pause in "abort" mode can end the probe's request before vLLM ran
    its prefill: no prompt logprobs, so nothing to judge the weights by."""
    from engines.outputs import RequestOutput

    async def aborted(prompt, params):
        return RequestOutput("r", prompt, [], 0, "e0", prompt_logprobs=None)

    probing(engine, monkeypatch, aborted)
    assert asyncio.run(engine.probe_logprobs([3, 4, 6])) is None


def test_a_prepared_actor_imports_and_starts_no_engine(monkeypatch):
    """`prepare_only` (engines/lifecycle/prepared.py): the forkserver and
    vLLM's imports, with the actor's environment set first; no engine
    arguments, no AsyncLLM; a sweep's shutdown is a no-op."""
    seen = {}

    def start(preload):
        seen["preload"] = preload
        seen["variable"] = os.environ.get("ROLLOUTFLOW_TEST_VARIABLE")

    def no_engine(*args, **kwargs):
        raise AssertionError("a prepared actor started an engine")

    monkeypatch.setattr(vllm_engine.forkserver, "start", start)
    monkeypatch.setattr(vllm_engine, "vllm_api", lambda: SimpleNamespace())
    monkeypatch.setattr(vllm_engine, "engine_args", no_engine)
    monkeypatch.setenv("ROLLOUTFLOW_TEST_VARIABLE", "unset")  # restored after the test
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    config = EngineConfig(name="p-1", seed=0, rpc_timeout_s=5, pretrain="m", max_len=8)
    engine = VLLMEngine(config, prepare_only=True, environment={"ROLLOUTFLOW_TEST_VARIABLE": "set"})
    assert seen == {"preload": vllm_engine.ENGINE_CORE_MODULES, "variable": "set"}
    assert engine.prepared and engine.config.name == "p-1"
    assert [p.name for p in engine.startup.phases] == ["imports", "vLLM imports"]
    asyncio.run(engine.shutdown())
