"""Where the CPU backend's model lives (the counterpart of a vLLM GPU worker):
loaded from the checkpoint with its tokenizer, run by the generation thread,
its weights updated through `collective_rpc` (`WeightSyncWorkerExtension`).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers.utils.logging

from engines import env
from engines.hf.adapters import PeftAdapters
from engines.startup import StartupClock
from engines.worker_extension import WeightSyncWorkerExtension


def torch_dtype(name: str) -> Any:
    """A dtype name `check_hf_kwargs` accepted, as torch's; "auto" (the
    checkpoint's) as is."""
    aliases = {"float": "float32", "half": "float16"}
    return "auto" if name == "auto" else getattr(torch, aliases.get(name, name))


class HFWorker(WeightSyncWorkerExtension):
    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.rank = 0

    def _model(self) -> torch.nn.Module:
        return self.model

    def new_adapter_store(self) -> PeftAdapters:
        """The LoRA adapters of this model: peft's (vLLM's manager is not here)."""
        return PeftAdapters(self)

    def adapters(self) -> Any:
        """The LoRA adapters synced into this model (`PeftAdapters`), or None."""
        return self._weight_worker().adapters


def load_model(
    pretrain: str, dtype: str, trust_remote_code: bool, clock: StartupClock
) -> tuple[Any, HFWorker]:
    """The checkpoint's tokenizer, and a worker holding its model in eval mode
    (on the GPU when there is one)."""
    torch.set_num_threads(env.torch_threads())
    transformers.utils.logging.disable_progress_bar()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        pretrain, trust_remote_code=trust_remote_code
    )
    clock.mark("tokenizer")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        pretrain,
        dtype=torch_dtype(dtype),
        trust_remote_code=trust_remote_code,
    )
    model.to(device).eval()
    clock.mark("model load")
    return tokenizer, HFWorker(model, device)
