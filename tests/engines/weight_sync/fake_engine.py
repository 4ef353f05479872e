"""A fake engine actor for unit tests of the session and transports: the
real `WeightSync` (composed, with the engine's delegating methods) and the
real worker router over a small torch module; generation is a flag."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from engines.admission import Admission
from engines.config import EngineConfig
from engines.weight_api import WeightApi
from engines.weight_sync.config import GroupInfo
from engines.weight_sync.group import WeightGroup, free_port
from engines.weight_sync.session import WeightSync
from engines.worker_extension import WeightSyncWorkerExtension


class FakeWorker(WeightSyncWorkerExtension):
    def __init__(self, model: torch.nn.Module, quantization: str | None = None):
        self.model = model
        self.device = torch.device("cpu")
        self.rank = 0
        # What a vLLM worker's `model_config` tells the loading rule.
        self.model_config = SimpleNamespace(quantization=quantization)

    def _model(self):
        return self.model


class FakeEngine(WeightApi):
    """The engine-actor surface `WeightSync` relies on (`EngineHost`), and nothing else."""

    def __init__(self, model: torch.nn.Module):
        self.config = EngineConfig(
            name="fake-0",
            pretrain="/nowhere",
            max_len=16,
            seed=0,
            gpu_memory_utilization=0.5,
            rpc_timeout_s=5.0,
        )
        self.weight_version = 0
        self.stale = False
        self.paused = False
        self.prefix_resets = 0
        self.worker = FakeWorker(model)
        self.weights = WeightSync(self)

    async def pause_generation(self):
        self.paused = True

    async def resume_generation(self):
        self.paused = False

    async def reset_prefix_cache(self):
        self.prefix_resets += 1
        return True

    async def wake_up(self, tags=None):
        raise AssertionError("no test here sleeps")

    def served_quantization(self):
        return None

    async def collective_rpc(self, method, args=(), kwargs=None, timeout_s=None):
        function = getattr(self.worker, method)
        return [await asyncio.to_thread(function, *args, **(kwargs or {}))]


class ProbedEngine(FakeEngine):
    """A FakeEngine with the real door (`Admission`, pause mode "keep") and a
    probe that answers `logprobs` once `probe_go` is set; `generate(name,
    done)` is a call whose work ends when `done` is set, logged in `events`."""

    def __init__(self, model: torch.nn.Module, logprobs: list[float]):
        super().__init__(model)
        self.door = Admission(
            freeze=self._nothing,
            thaw=self._nothing,
            abort=self._nothing,
            version=lambda: self.weight_version,
        )
        self.logprobs = logprobs
        self.probe_started, self.probe_go = asyncio.Event(), asyncio.Event()
        self.events: list[str] = []

    async def _nothing(self) -> None:
        pass

    async def pause_generation(self):
        await self.door.close("keep")

    async def resume_generation(self):
        await self.door.open()

    def hold_outputs(self) -> None:
        self.door.hold()

    def release_outputs(self, error) -> None:
        self.door.settle(error)

    async def probe_logprobs(self, token_ids):
        self.probe_started.set()
        await self.probe_go.wait()
        return self.logprobs

    async def generate(self, name: str, done: asyncio.Event) -> str:
        async with self.door.request():
            self.events.append(f"{name} in")
            await done.wait()
            self.events.append(f"{name} computed")
        return name


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def assert_state(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in module.named_parameters():
        assert torch.equal(tensor.detach(), expected[name]), name


def run(coro):
    return asyncio.run(coro)


async def join(engine: FakeEngine, timeout_s: float = 10.0) -> WeightGroup:
    """A trainer's gloo group (rank 0, returned) with the engine's one worker (rank 1)."""
    info = GroupInfo("127.0.0.1", free_port(), 2, "test-group", "gloo", timeout_s)
    trainer = asyncio.create_task(asyncio.to_thread(WeightGroup, info, 0))
    await engine.init_process_group(
        info.master_address, info.master_port, 1, 2, info.group_name, backend="gloo"
    )
    return await trainer
