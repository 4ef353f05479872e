"""Random tiny models in the layouts of the architectures weight sync is
checked on: Llama 3, Qwen2 with tied embeddings, Qwen3, Mistral, Gemma 2 and
two mixture-of-experts models (Qwen2-MoE with a shared expert, Qwen3-MoE).
Built offline from transformers configs (CPU:
tests/engines/weight_sync/test_architectures.py; GPU with vLLM:
tests/gpu/test_gpu_architectures.py, tests/gpu/test_gpu_weight_formats.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: vLLM's model class for each (what the copy plan replays only when proven).
VLLM_CLASSES = {
    "llama3": "LlamaForCausalLM",
    "qwen2-tied": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "qwen2-moe": "Qwen2MoeForCausalLM",
    "qwen3-moe": "Qwen3MoeForCausalLM",
}
ARCHITECTURES = tuple(VLLM_CLASSES)


def config(arch: str, vocab_size: int = 96, hidden: int = 32, layers: int = 2, **extra: Any):
    from transformers import (
        Gemma2Config,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        **extra,
    )
    head_dim = hidden // 4
    if arch == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        return LlamaConfig(**common, rope_scaling=rope, tie_word_embeddings=False)
    if arch == "qwen2-tied":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim, tie_word_embeddings=False)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if arch == "gemma2":
        return Gemma2Config(**common, head_dim=head_dim)
    if arch == "qwen2-moe":
        return Qwen2MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2,
            shared_expert_intermediate_size=hidden,
            decoder_sparse_step=1,
            tie_word_embeddings=False,
        )
    if arch == "qwen3-moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=head_dim,
            num_experts=4,
            num_experts_per_tok=2,
            # 2I != H: an expert read transposed would not fit.
            moe_intermediate_size=hidden // 4,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown architecture {arch!r}; use one of {ARCHITECTURES}")


def build(arch: str, seed: int = 0, **kwargs: Any):
    """The model, random weights from `seed`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(arch, **kwargs)).eval()


def write(arch: str, path: str | Path, seed: int = 0, dtype: str = "bfloat16", **kwargs) -> Path:
    """The model and the tiny tokenizer, saved as an HF checkpoint directory."""
    import torch

    from engines.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    ids = dict(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = build(arch, seed, vocab_size=320, **ids, **kwargs).to(getattr(torch, dtype))
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
