"""The rollout engine interface: one class per backend implements it, and each
engine runs as one (async) Ray actor.

Method names and arguments follow OpenRLHF's `LLMRayActor` where it has them,
so code written against OpenRLHF's engines drives ours unchanged. Optional
hooks default to no-ops; `health()` raises when the engine cannot serve.

This module holds generation, the engine's start and restart in its actor
(and in a prepared actor, `adopt`),
health and worker RPCs, and the checks every request passes; the actor's
other methods come from the classes `RolloutEngine` inherits, each in its
own module: pause and sleep (`engines.control`), the OpenAI endpoint
(`engines.serving`), weight sync (`engines.weight_api`), OpenRLHF's agent
rollouts (`engines.openrlhf.agents`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
from typing import Any

from engines.admission import Admission
from engines.config import EngineConfig
from engines.control import ControlApi
from engines.errors import (
    EngineDeadError,
    EngineSleepingError,
    EngineStaleError,
    PromptTooLongError,
    RequestError,
)
from engines.load import EngineLoad
from engines.openrlhf.agents import AgentApi
from engines.outputs import RequestOutput
from engines.sampling import SamplingParams
from engines.serving import EndpointApi
from engines.startup import StartupClock, StartupReport
from engines.weight_api import WeightApi
from engines.weight_sync.session import WeightSync

logger = logging.getLogger(__name__)

#: How long a prepared actor waits for a lost engine's resources, and then its memory.
ANCHOR_TIMEOUT_S = 60.0


def normalize_prompts(prompts: Any) -> tuple[list[list[int]], bool]:
    """One prompt or a batch -> (the batch, whether it was one prompt).

    A prompt is a list of token ids or a TokensPrompt-like dict
    (`{"prompt_token_ids": [...]}`), as vLLM takes them."""
    if isinstance(prompts, dict):
        return [_token_ids(prompts, 0)], True
    if not isinstance(prompts, list | tuple) or len(prompts) == 0:
        raise RequestError(
            f"prompt_token_ids must be a non-empty list of token ids or of such lists, "
            f"got {type(prompts).__name__} {str(prompts)[:80]}"
        )
    if all(isinstance(t, int) for t in prompts):
        return [list(prompts)], True
    return [_token_ids(prompt, i) for i, prompt in enumerate(prompts)], False


def _token_ids(prompt: Any, i: int) -> list[int]:
    if isinstance(prompt, dict):
        extra = set(prompt) - {"prompt_token_ids"}
        if extra:
            raise RequestError(f"prompt {i}: unsupported TokensPrompt keys {sorted(extra)}")
        prompt = prompt.get("prompt_token_ids")
    if not isinstance(prompt, list | tuple) or not prompt:
        raise RequestError(f"prompt {i} is not a non-empty list of token ids: {prompt!r:.80}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError(f"prompt {i} holds non-integer token ids: {prompt!r:.80}")
    return list(prompt)


class RolloutEngine(ControlApi, EndpointApi, WeightApi, AgentApi, abc.ABC):
    """One rollout engine (all its tensor-parallel workers); its pause and
    sleep methods are `ControlApi`'s, its OpenAI endpoint `EndpointApi`'s,
    its weight-sync methods `WeightApi`'s, OpenRLHF's agent rollouts
    `AgentApi`'s."""

    backend: str = ""
    #: A `restart` or `adopt` in progress, or done (its outcome); `ready` waits for it.
    _restart: asyncio.Future | None = None
    #: A prepared actor with no engine yet (`_prepare`): it answers `adopt`.
    prepared: bool = False

    @classmethod
    def check_settings(cls, engine_kwargs: dict[str, Any], tool_call_parser: str | None) -> None:
        """Raises `EngineSpecError` for what this backend does not accept; run
        on the driver before any engine exists (`EngineSetSpec.engine_kwargs_for`).
        Nothing here: vLLM checks its own engine arguments as it starts."""

    def __init__(self, config: EngineConfig):
        # A backend's __init__(config, clock=None) starts its engine, timing
        # the phases on `clock` (default: from the actor's first import).
        self.config = config
        # Version of the weights being served; stamped on every output. A sync
        # that fails part-way marks the engine stale: it refuses work until resynced.
        self.weight_version = 0
        self.stale = False
        # Tags still asleep after `sleep`; the engine serves only when empty.
        self._asleep: set[str] = set()
        self.weights = WeightSync(self)  # weight sync; WeightApi's methods delegate to it
        self._admission = Admission(
            freeze=self._freeze,
            thaw=self._thaw,
            abort=self._abort_requests,
            version=lambda: self.weight_version,
        )

    # --- generation ---------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: Any,
        sampling_params: Any = None,
        multi_modal_data: Any = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Generate as vLLM's engine does: one prompt (token ids or a
        TokensPrompt-like dict) gives one RequestOutput, a list of prompts a
        list in order; each holds `sampling_params.n` completions. Concurrent
        calls share batches."""
        if multi_modal_data:
            raise RequestError(
                "multi_modal_data is not supported yet (text-only engines); got keys "
                f"{sorted(multi_modal_data) if isinstance(multi_modal_data, dict) else '?'}"
            )
        prompts, single = normalize_prompts(prompt_token_ids)
        outputs = await self._generate(prompts, sampling_params)
        return outputs[0] if single else outputs

    @abc.abstractmethod
    async def _generate(
        self, prompts: list[list[int]], sampling_params: Any
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order."""

    async def generate_text(
        self, prompts: str | list[str], sampling_params: Any = None
    ) -> RequestOutput | list[RequestOutput]:
        """Text-prompt convenience: tokenize, then `generate` (one string gives
        one RequestOutput, a list a list); outputs carry the text as `prompt`."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        outputs = await self._generate([self.encode(p) for p in texts], sampling_params)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs[0] if isinstance(prompts, str) else outputs

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with the engine's tokenizer."""

    @abc.abstractmethod
    async def get_num_unfinished_requests(self) -> int: ...

    @abc.abstractmethod
    async def load(self) -> EngineLoad:
        """Sequences running and waiting, and the KV cache's use: what the
        dispatcher admits more work by."""

    # --- life and health ----------------------------------------------------
    @abc.abstractmethod
    async def health(self) -> dict[str, Any]:
        """Engine state; raises if the engine cannot serve."""

    async def ready(self) -> str:
        """Returns the engine's name once it can serve (start-up is done in
        __init__, or in a `restart` or `adopt` begun before this call)."""
        if self.prepared and self._restart is None:
            # Ray may run an async actor's calls out of the order they were
            # sent (https://docs.ray.io/en/latest/ray-core/actors/task-orders.html):
            # a ready() sent after adopt() to an actor still importing ran
            # first on one H100 and found no engine.
            await self._adopting.wait()
        if self._restart is not None:
            await asyncio.shield(self._restart)
        await self.health()
        await self._serve_openai()
        return self.config.name

    async def restart(self) -> None:
        """Begin starting the engine again inside this actor, after its engine
        died and the actor did not (vLLM's engine-core process, the CPU
        engine's generation thread): the process, its imports, vLLM's
        forkserver and the Ray worker are kept, so this costs the engine's
        own start only. Returns at once; `ready()` waits for the restart and
        raises its error. The engine serves the weights it loads, at version
        0, as a new engine would."""
        name = self.config.name
        if self._restart is not None:
            if not self._restart.done():
                raise RequestError(f"engine {name} is already restarting")
            if self._restart.cancelled() or self._restart.exception() is not None:
                # Half started: only a new actor is sure to start clean.
                raise EngineDeadError(f"engine {name} failed to restart in this actor before")
        self._restart = asyncio.ensure_future(self._start_again())

    async def _start_again(self) -> None:
        try:
            await self.shutdown()
            # Everything `__init__` sets is the engine's state, so starting
            # again is `__init__` again; in a thread: it blocks for the whole start.
            clock = StartupClock()
            await asyncio.to_thread(type(self).__init__, self, self.config, clock)
        except Exception as exc:
            raise EngineDeadError(
                f"engine {self.config.name} did not restart in its actor: {exc!r}",
                engine=self.config.name,
            ) from exc
        logger.info("engine %s restarted in %.1fs", self.config.name, self.startup.seconds)

    # --- a prepared actor: imports done, no engine (engines.lifecycle.prepared) --
    def _prepare(self, config: EngineConfig, clock: StartupClock) -> None:
        """The end of a prepared actor's `__init__`: its imports are done and
        it has no engine until `adopt`; `config` is the set's template under
        this actor's name. Its start-up report holds the imports."""
        self.config = config
        self.prepared = True
        self._adopting = asyncio.Event()  # set by `adopt`; `ready` waits for it
        self.startup = clock.report(config.name, self.backend)
        logger.info("prepared actor %s: imports done in %.1fs", config.name, self.startup.seconds)

    async def adopt(
        self, config: EngineConfig, env_vars: dict[str, str], anchor: dict[str, Any]
    ) -> None:
        """Begin, in this prepared actor, the engine of one whose actor was
        lost: `config` is the lost engine's under this actor's name,
        `env_vars` its actor's environment, `anchor` the Ray options that hold
        its resources on its bundle (`engines.lifecycle.anchor`).
        Returns at once; `ready()` waits for the engine and raises its error."""
        if not self.prepared or self._restart is not None:
            raise RequestError(f"{self.config.name} is not a prepared actor awaiting an engine")
        self._restart = asyncio.ensure_future(self._adopt(config, env_vars, anchor))
        self._adopting.set()

    async def _adopt(
        self, config: EngineConfig, env_vars: dict[str, str], anchor: dict[str, Any]
    ) -> None:
        import ray

        from engines.lifecycle.anchor import Anchor

        clock = StartupClock()
        try:
            # Kept for this actor's life: Ray ends an actor whose handles are gone.
            self._anchor = ray.remote(Anchor).options(**anchor).remote()
            devices = await asyncio.wait_for(self._anchor.devices.remote(), ANCHOR_TIMEOUT_S)
            os.environ.update(env_vars)
            if devices is not None:
                # Read as the engine starts (vLLM's core is forked with this
                # environment: engines/vllm/forkserver.py); nothing before it
                # here has initialised CUDA.
                os.environ["CUDA_VISIBLE_DEVICES"] = devices
            clock.mark("the lost engine's resources held (its bundle freed)")
            await self._await_room(config, ANCHOR_TIMEOUT_S)
            clock.mark("its memory freed on the GPU")
            await asyncio.to_thread(type(self).__init__, self, config, clock)
        except Exception as exc:
            raise EngineDeadError(
                f"{config.name} could not take the lost engine's place: {exc!r}",
                engine=config.name,
            ) from exc
        self.prepared = False
        logger.info(
            "engine %s started in a prepared actor in %.1fs", config.name, self.startup.seconds
        )

    async def _await_room(self, config: EngineConfig, timeout_s: float) -> None:  # noqa: B027
        """Before an adopted engine starts: wait until its device has the room
        the engine asks for (the lost engine's memory freed). No GPU: none."""

    async def startup_report(self) -> StartupReport:
        """Where this engine's start-up time went (set at the end of `__init__`)."""
        return self.startup

    async def reset_prefix_cache(self) -> bool:
        return True

    async def shutdown(self) -> None:  # noqa: B027 - an optional hook
        """Free the engine's resources before the actor is killed."""

    async def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Run `method` of the worker extension on every worker of this engine
        (one per tensor-parallel rank); results in rank order. Weight updates go
        through here on both backends. `timeout_s` (default: the engine's RPC
        timeout) bounds the call; a whole-model receive passes a longer one."""
        if not isinstance(method, str) or method.startswith("_"):
            raise RequestError(f"collective_rpc needs a public worker method name, got {method!r}")
        timeout = self.config.rpc_timeout_s if timeout_s is None else timeout_s
        return await self._rpc(method, args, kwargs or {}, timeout)

    @abc.abstractmethod
    async def _rpc(self, method: Any, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        """`collective_rpc` once checked: the backend's call into its workers,
        bounded by `timeout` seconds."""

    # --- helpers for backends -------------------------------------------------
    def check_request(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Per-request validation; raises RequestError, the engine keeps serving."""
        for i, prompt in enumerate(prompts):
            if not prompt:  # an empty text: nothing to generate from
                raise RequestError(f"prompt {i} is empty (engine {self.config.name})")
            if len(prompt) >= self.config.max_len:
                raise PromptTooLongError(
                    f"prompt {i} has {len(prompt)} tokens; max_len={self.config.max_len} "
                    f"leaves no room to generate (engine {self.config.name})"
                )
        if self._asleep:
            raise EngineSleepingError(
                f"engine {self.config.name} is asleep ({sorted(self._asleep)}); call wake_up first"
            )
        if self.stale:
            # An engine failure, not a bad request: the caller's work goes to
            # another engine (or this one once resynced or replaced).
            raise EngineStaleError(
                f"engine {self.config.name} holds stale weights after a failed sync "
                f"(version {self.weight_version}); resync before sending work",
                engine=self.config.name,
            )

    def base_health(self) -> dict[str, Any]:
        return {
            "alive": True,
            "name": self.config.name,
            "backend": self.backend,
            "model": self.config.pretrain,
            "weight_version": self.weight_version,
            "stale": self.stale,
            "seed": self.config.seed,
            "bundle_indices": list(self.config.bundle_indices),
        }
