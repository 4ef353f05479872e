"""The reference policy as a Ray actor beside the engines (`create_policy_actor`),
and, on the engines' GPU, started before they are up (`loading_after`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from training.config import PolicyConfig
from training.policy import ReferencePolicy

logger = logging.getLogger(__name__)


def create_policy_actor(
    config: PolicyConfig | dict,
    *,
    name: str | None = None,
    namespace: str | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    scheduling_strategy: Any = None,
    policy_class: type[ReferencePolicy] = ReferencePolicy,
    after: list[Any] | None = None,
    after_timeout_s: float = 600.0,
):
    """Start `policy_class` (`ReferencePolicy`, or a subclass) as a Ray actor
    (loads the model in the background; `ray.get(actor.health.remote())`
    waits for it). `scheduling_strategy`: e.g. a bundle of the engines'
    placement group, to share their GPU (`EnginePlacement.trainer_options`).
    `after`: refs its model's load waits for, at most `after_timeout_s`
    (`loading_after`)."""
    import ray

    config = PolicyConfig.model_validate(config)
    threads = str(config.torch_threads)
    options: dict[str, Any] = dict(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_restarts=0,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}},
    )
    if scheduling_strategy is not None:
        options["scheduling_strategy"] = scheduling_strategy
    if name is not None:
        options.update(name=name, namespace=namespace)
    if after is None:
        return ray.remote(policy_class).options(**options).remote(config.model_dump())
    # In a list, the refs reach the actor as refs: Ray would wait for
    # top-level ones before starting it, imports and all.
    actor_class = ray.remote(loading_after(policy_class)).options(**options)
    return actor_class.remote(config.model_dump(), list(after), after_timeout_s)


def loading_after(policy_class: type[ReferencePolicy]) -> type[ReferencePolicy]:
    """`policy_class`, its actor started before the engines on its GPU are
    up: it imports what its load needs (`preimport`), then waits for
    `after` (their `ready`, the spares' sleep) before its model loads, as
    an engine waits its turn (`engines.startup.wait_turn`): memory taken
    while vLLM sizes its KV cache leaves that engine without one. Their
    outcome does not matter: a failed engine frees its memory too. (A
    replacement started after a failure waits for nothing, as
    `replace_engine` starts it beside the others.)"""

    class LoadsAfter(policy_class):
        def __init__(self, config: PolicyConfig | dict, after: list[Any], timeout_s: float):
            began = time.monotonic()
            import ray

            preimport(PolicyConfig.model_validate(config))
            imported = time.monotonic()
            done, _ = ray.wait(after, num_returns=len(after), timeout=timeout_s)
            if len(done) < len(after):
                logger.warning("the policy loads after %gs without the engines up", timeout_s)
            waited = time.monotonic()
            super().__init__(config)
            self.startup = dataclasses.replace(
                self.startup,
                imports_s=imported - began + self.startup.imports_s,
                turn_s=waited - imported,
            )

    # Ray names the actor's class by it (`ray list actors`, the dashboard).
    LoadsAfter.__name__ = LoadsAfter.__qualname__ = policy_class.__name__
    return LoadsAfter


def preimport(config: PolicyConfig) -> None:
    """What the policy's load imports, without touching CUDA: torch,
    transformers and the model's own class (imported on first use, most of
    a small model's load: 1.4 of 1.5 s on the 2-core box), and peft for an
    adapter."""
    import torch  # noqa: F401
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    kind = type(AutoConfig.from_pretrained(config.pretrain))
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING:  # else remote code: loaded with the model
        MODEL_FOR_CAUSAL_LM_MAPPING[kind]
    if config.lora_rank is not None:
        import peft  # noqa: F401
