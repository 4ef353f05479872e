"""vLLM 0.26's online FP8 (`Fp8PerTensorOnlineLinearMethod` with CUTLASS, as
on an H200), computed on a transformers model: e4m3 weights with one scale
per tensor vLLM holds (q/k/v fused into one, gate/up into one), e4m3
activations with one scale per token, products summed in fp32, output in
the model's dtype; the head and embeddings stay as they are, as vLLM leaves
them. The GPU trainer's FP8 reference (tests/gpu/gpu_trainer.py) and the
CPU probe tests' FP8 engine (tests/engines/weight_sync/test_probe.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: vLLM's fused linear layers: their HF parts share one FP8 weight scale.
FUSED_LINEARS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def fp8_round(tensor: Any, scale: Any) -> Any:
    """`tensor` rounded to e4m3 at `scale` (vLLM's `scaled_fp8_quant`), in fp32."""
    import torch

    return (tensor.float() / scale).to(torch.float8_e4m3fn).float() * scale


def fp8_linears(model: Any) -> dict[Any, Any]:
    """Each decoder linear layer (not the head) -> its weight rounded to e4m3
    with the scale of the tensor vLLM fuses it into (amax / 448)."""
    import torch

    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    groups: dict[str, list[tuple[Any, Any]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            parent, _, leaf = name.rpartition(".")
            groups.setdefault(f"{parent}.{FUSED_LINEARS.get(leaf, leaf)}", []).append(
                (module, module.weight.detach())
            )
    rounded = {}
    for members in groups.values():
        scale = max(float(w.abs().max()) for _, w in members) / fp8_max
        rounded.update({module: fp8_round(w, scale) for module, w in members})
    return rounded


def fp8_forward(weight: Any):
    """A linear layer's forward with per-token e4m3 activations."""
    import torch

    fp8_max = torch.finfo(torch.float8_e4m3fn).max

    def forward(x: Any) -> Any:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / fp8_max).clamp(min=1e-12)
        return (fp8_round(x, scale) @ weight.t()).to(x.dtype)

    return forward


@contextlib.contextmanager
def fp8_computed(model: Any) -> Iterator[None]:
    """Inside, `model`'s decoder linear layers compute as vLLM's online FP8
    does, on their weights as they are on entry; the class's forward after."""
    linears = fp8_linears(model)
    try:
        for module, weight in linears.items():
            module.forward = fp8_forward(weight)
        yield
    finally:
        for module in linears:
            del module.forward
