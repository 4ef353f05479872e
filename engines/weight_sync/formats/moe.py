"""Mixture-of-experts layouts, as the manifest check sees them.

A transformers-5 trainer holds a MoE layer's experts fused:
`mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up
rows) and `mlp.experts.down_proj` [E, H, I]. A checkpoint, and so a vLLM
engine's manifest (read from the checkpoint it loaded), names each expert:
`mlp.experts.<e>.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj`
[H, I].

vLLM 0.26's MoE loader takes the fused tensors as they are
(`RoutedExperts.load_weights` in vllm/model_executor/layers/fused_moe/
routed_experts.py: a 3-D tensor is unbound by expert and its gate/up halves
chunked on dim 1, the same split transformers' forward makes), so no byte is
converted anywhere: the trainer sends its tensors unchanged through every
transport (no copy, two tensors per layer instead of 3E), and only the
engine's manifest check reads a fused tensor as the per-expert tensors it
stands for. The CPU engine is a transformers-5 model itself: it holds the
fused names and checks them as they are.
"""

from __future__ import annotations

from collections.abc import Collection

from engines.weight_sync.formats.manifest import Manifest, ParamSpec

#: A fused expert tensor's name -> the checkpoint's per-expert matrices it
#: holds, in the order they are stacked on its dim 1.
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def per_expert(spec: ParamSpec) -> tuple[ParamSpec, ...] | None:
    """The per-expert specs a fused expert tensor stands for (the names and
    shapes `save_pretrained` writes); None for any other tensor."""
    layer, _, leaf = spec.name.rpartition(".")
    parts = FUSED_EXPERTS.get(leaf)
    if parts is None or not layer.endswith("experts") or len(spec.shape) != 3:
        return None
    experts, rows, columns = spec.shape
    if rows % len(parts):
        return None
    shape = (rows // len(parts), columns)
    return tuple(
        ParamSpec(name=f"{layer}.{expert}.{part}.weight", dtype=spec.dtype, shape=shape)
        for expert in range(experts)
        for part in parts
    )


def in_engine_layout(got: Manifest, held: Collection[str]) -> Manifest:
    """The trainer's manifest `got`, each fused expert tensor the engine does
    not hold by that name (`held`: the names of its manifest) replaced by
    the per-expert tensors it stands for; everything else as it is."""
    params: list[ParamSpec] = []
    for spec in got.params:
        split = None if spec.name in held else per_expert(spec)
        params.extend(split or (spec,))
    return Manifest(params=tuple(params))
