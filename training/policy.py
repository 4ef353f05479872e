"""The reference policy: a transformers causal LM trained with a GRPO-style
step, meant to run as a Ray actor next to the engines (`training.policy_actor`).
It is the smallest real trainer, for the CPU tests and demo flow; large
models plug in their own `Trainer`."""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.weight_sync import LoraSpec, LoraSync
from engines.weight_sync.probe import ProbeReference, reference
from training.config import PolicyConfig
from training.grpo import group_advantages, micro_batches, token_logprobs
from training.loss import OffPolicyStats, micro_batch_loss
from training.rollouts import RolloutGroup, RolloutSample, StaleRolloutError
from training.sync_buffer import SyncBuffer
from training.trainer import StepReport, Trainer

logger = logging.getLogger(__name__)


def checkpoint_dtype(pretrain: str) -> str:
    """The dtype the checkpoint was saved in (what `dtype="auto"` loads); read
    from its config, since loading in float32 rewrites the model's. A local
    checkpoint's config.json is read as transformers reads it (`dtype`, else
    the older `torch_dtype`): the flow's process asks before it starts the
    policy, and would otherwise import transformers for it (seconds of CPU,
    on the way to the policy's start)."""
    config = Path(pretrain, "config.json")
    if config.is_file():
        saved = json.loads(config.read_text())
        dtype = saved.get("dtype") if saved.get("dtype") is not None else saved.get("torch_dtype")
    else:  # a hub id
        from transformers import AutoConfig

        dtype = getattr(AutoConfig.from_pretrained(pretrain), "dtype", None)
    return str(dtype or "float32").removeprefix("torch.")


#: vLLM's spellings of the dtypes a sync can send.
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
           "float16": "float16", "half": "float16"}  # fmt: skip


def engine_dtype(pretrain: str, backend: str, engine_kwargs: dict) -> str:
    """The dtype the engines hold the weights in, which a sync must send: the
    engine's `dtype` argument, else what "auto" loads. vLLM serves a float32
    checkpoint in bf16 on Ampere and newer (`_resolve_auto_dtype` in
    vllm/config/model.py; older GPUs get fp16: pass `dtype` there); the CPU
    engine keeps the checkpoint's."""
    asked = str(engine_kwargs.get("dtype", "auto")).removeprefix("torch.")
    if asked != "auto":
        if asked not in _DTYPES:
            raise ValueError(f"engine dtype {asked!r}: a sync sends one of {sorted(_DTYPES)}")
        return _DTYPES[asked]
    saved = checkpoint_dtype(pretrain)
    return "bfloat16" if backend == "vllm" and saved == "float32" else saved


@contextlib.contextmanager
def tf32_matmuls(device: Any) -> Iterator[None]:
    """A step's float32 matmuls on TF32 tensor cores, on CUDA: torch's
    default ("highest") runs them on the far slower full-precision units,
    which made the step, not generation, the long-tail run's bottleneck.
    TF32 rounds the inputs to 10 mantissa bits, finer than the bf16 the
    engines compute in; the weights stay float32, and outside the step
    (the probe's reference) matmuls keep full precision."""
    import torch

    if getattr(device, "type", device) != "cuda":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def alloc_retries(device: Any) -> int:
    """How often torch's CUDA allocator has failed to allocate, freed its
    cache and tried again on `device` (0 off CUDA): each retry waits for the
    GPU and gives memory back to the driver, so a step that retries runs far
    slower, with nothing else in its figures to say why."""
    import torch

    if getattr(device, "type", device) != "cuda":
        return 0
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


@dataclass(frozen=True)
class PolicyStartup:
    """Where a policy actor's start went, in seconds. A colocated policy's
    start decides whether the engines still have work when its first step
    begins (docs/schedules.md)."""

    imports_s: float
    #: Waiting for the engines on its GPU to be up, its imports done
    #: (`create_policy_actor`'s `after`); 0 when it did not wait.
    turn_s: float
    model_s: float
    #: The optimizer, the adapter, the sync buffer.
    rest_s: float


class ReferencePolicy(Trainer):
    def __init__(self, config: PolicyConfig | dict):
        began = time.monotonic()
        import torch
        from transformers import AutoModelForCausalLM

        imported = time.monotonic()
        self.config = PolicyConfig.model_validate(config)
        torch.set_num_threads(self.config.torch_threads)
        torch.manual_seed(self.config.seed)
        self.device = torch.device(self.config.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.config.pretrain, dtype=torch.float32
        ).to(self.device)
        loaded = time.monotonic()
        self.lora = self._lora()
        if self.lora is not None:
            from peft import LoraConfig, get_peft_model

            # peft starts lora_B at zero: the adapter of version 0 is the base model.
            self.model = get_peft_model(self.model, LoraConfig(**self._peft_kwargs()))
        # No dropout in the models we train; eval() keeps the forward identical
        # to the engines', while autograd still works.
        self.model.eval()
        self.sync_dtype = getattr(
            torch, self.config.sync_dtype or checkpoint_dtype(self.config.pretrain)
        )
        self._sync_buffer = SyncBuffer(self.sync_dtype)
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.config.learning_rate,
            weight_decay=self.config.weight_decay,
        )
        self.weight_version = 0
        self.startup = PolicyStartup(
            imports_s=imported - began,
            turn_s=0.0,
            model_s=loaded - imported,
            rest_s=time.monotonic() - loaded,
        )
        logger.info("policy %s loaded on %s", self.config.pretrain, self.device)

    # --- Trainer ------------------------------------------------------------------------
    def named_weights(self) -> list[tuple[str, Any]]:
        """float32 master weights, sent in the engines' dtype (a bf16 vLLM
        engine accepts bf16 only): cast into the one buffer of `SyncBuffer`,
        written again by the next call. With LoRA, the adapter's alone
        (peft's names)."""
        if self.lora is not None:
            from peft import get_peft_model_state_dict

            return self._sync_buffer.cast(list(get_peft_model_state_dict(self.model).items()))
        return self._sync_buffer.cast(list(self.model.named_parameters()))

    def _lora(self) -> LoraSync | None:
        c = self.config
        if c.lora_rank is None:
            return None
        spec = LoraSpec(c.lora_rank, c.lora_alpha, tuple(c.lora_target_modules))
        # Under in_flight the engines keep max_staleness + 1 adapters, so
        # requests finish on the adapter they were admitted under.
        return LoraSync(spec, keep=c.max_staleness + 1)

    def _peft_kwargs(self) -> dict[str, Any]:
        spec = self.lora.spec
        return dict(
            r=spec.rank,
            lora_alpha=spec.alpha,
            target_modules=list(spec.target_modules),
            bias="none",
        )

    def lora_sync(self) -> LoraSync | None:
        return self.lora

    def probe_reference(self) -> ProbeReference:
        # The float32 master weights, held to the tolerance of the dtype sent.
        return reference(self.model, self.model.config.vocab_size, self.sync_dtype)

    def init_weight_sync(self, engines: list[Any], **kwargs: Any) -> dict[str, Any]:
        """As `Trainer.init_weight_sync`, with defaults from the config."""
        c = self.config
        kwargs.setdefault("transport", c.transport)
        kwargs.setdefault("backend", c.sync_backend)
        kwargs.setdefault("checkpoint_dir", c.checkpoint_dir)
        kwargs.setdefault(
            "sync_config",
            dict(
                bucket_bytes=c.bucket_bytes,
                timeout_s=c.sync_timeout_s,
                verify=c.verify,
                on_failure=c.on_failure,
                probe=c.probe,
            ),
        )
        return super().init_weight_sync(engines, **kwargs)

    def train_step(self, groups: list[RolloutGroup | dict]) -> StepReport:
        """A GRPO step as decoupled PPO: the ratio is taken against the
        policy's own logprobs before the step ("proximal", detached), and each
        token's term is weighted by min(pi_proximal / pi_behaviour, tis_cap)
        when the row carries the engine's (behaviour) logprobs, which corrects
        rows sampled by an older version or by the engine's numerics."""
        started = time.monotonic()
        retries = alloc_retries(self.device)
        groups = [RolloutGroup.model_validate(g) for g in groups]
        if not groups:
            raise ValueError("train_step needs at least one rollout group")
        self._check_fresh(groups)
        samples, advantages = [], []
        for group in groups:
            samples += group.samples
            advantages += group_advantages(group.rewards)
        rewards = [r for g in groups for r in g.rewards]
        staleness = [self.weight_version - s.oldest_version for s in samples]
        trained = [
            (s, a)
            for s, a in zip(samples, advantages, strict=True)
            if a != 0.0 and s.sampled_tokens
        ]
        off_policy = OffPolicyStats()
        loss_value, grad_norm = self._update(trained, off_policy) if trained else (0.0, 0.0)
        # Every step makes a new version, even one without signal: what the
        # engines serve is then unambiguous.
        self.weight_version += 1
        if retried := alloc_retries(self.device) - retries:
            logger.warning(
                "step %d: the CUDA allocator ran out of memory and retried %d times "
                "(engines on the same GPU hold the rest?): lower micro_batch_tokens "
                "or the engines' gpu_memory_utilization",
                self.weight_version,
                retried,
            )
        return StepReport(
            version=self.weight_version,
            loss=loss_value,
            grad_norm=grad_norm,
            mean_reward=statistics.fmean(rewards),
            reward_std=statistics.pstdev(rewards),
            samples=len(samples),
            trained_samples=len(trained),
            trained_tokens=sum(
                len(s.prompt_token_ids) + len(s.completion_token_ids) for s, _ in trained
            ),
            seconds=time.monotonic() - started,
            staleness_max=max(staleness),
            staleness_mean=statistics.fmean(staleness),
            **off_policy.report(),
        )

    def _update(
        self, trained: list[tuple[RolloutSample, float]], off_policy: OffPolicyStats
    ) -> tuple[float, float]:
        """One optimizer step on the mean loss of `trained` (samples with
        their advantages); returns the loss and the gradient's norm."""
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        sequences = [s.prompt_token_ids + s.completion_token_ids for s, _ in trained]
        # The loss is the mean over every trained sample, its gradient
        # accumulated over micro-batches: activations for one at a time.
        # Nothing is read back until the step ends, so the CPU queues the
        # micro-batches while the GPU runs the ones before.
        losses = []
        with tf32_matmuls(self.device), self._compute_dtype():
            for batch in micro_batches(sequences, self.config.micro_batch_tokens):
                logprobs = token_logprobs(self.model, [sequences[i] for i in batch], self.pad_id)
                loss = micro_batch_loss(
                    [trained[i] for i in batch],
                    logprobs,
                    clip_eps=self.config.clip_eps,
                    tis_cap=self.config.tis_cap,
                    off_policy=off_policy,
                )
                loss = loss.sum() / len(trained)
                loss.backward()
                losses.append(loss.detach())
        loss_value = float(torch.stack(losses).sum())
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        )
        self.optimizer.step()
        return loss_value, grad_norm

    def _compute_dtype(self) -> contextlib.AbstractContextManager:
        import torch

        if self.config.compute_dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.config.compute_dtype))

    def _check_fresh(self, groups: list[RolloutGroup]) -> None:
        oldest = min(s.oldest_version for g in groups for s in g.samples)
        if self.weight_version - oldest > self.config.max_staleness:
            raise StaleRolloutError(
                f"rollouts from weight version {oldest}, policy is at {self.weight_version} "
                f"(max_staleness={self.config.max_staleness}): sync the engines before generating"
            )

    def health(self) -> dict[str, Any]:
        return {
            "weight_version": self.weight_version,
            "synced_version": self._synced_version,
            "pretrain": self.config.pretrain,
            "device": str(self.device),
        }

    def startup_report(self) -> PolicyStartup:
        return self.startup
