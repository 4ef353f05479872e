"""A tiny random-weight Llama with a byte-level tokenizer, built offline and
deterministically: the default model of tests and demo runs (nothing is
downloaded from a hub).

Llama, not Qwen2: transformers 5 rebuilds a `Qwen2Tokenizer` for
`model_type=qwen2` with its own pre-tokenizer, so token ids would change on
reload; a Llama-type model keeps our `tokenizer.json` as saved.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from engines import env

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
# Bump when the recipe changes, so cached copies are rebuilt.
RECIPE_VERSION = 2
#: A small chat template of its own, so `--apply-chat-template` runs offline:
#: one line per message ("<role>: <content>"), then "assistant: " to answer.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def default_model_dir() -> Path:
    root = os.environ.get(env.CACHE_DIR) or os.path.join(
        os.path.expanduser("~"), ".cache", "rolloutflow"
    )
    return Path(root) / f"tiny-llama-v{RECIPE_VERSION}"


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Pure byte-level BPE with no merges: every byte is one token, so any text
    # round-trips and ids are stable across library versions.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    dtype: str = "float32",
    init_std: float = 0.1,
    max_positions: int = 4096,
) -> Path:
    """Write a small random Llama (weights from `seed`) and its tokenizer to
    `path`. The defaults are the tests' tiny model (~115k parameters); the GPU
    tests use e.g. layers=24, hidden=896, heads=14 (~0.36B). `max_positions`:
    the longest sequence vLLM will take (its `max_model_len` may not pass it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    vocab_size = 320  # 259 tokens, padded to a multiple of 64
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2 if layers <= 2 else hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    # For the tiny model a wider initialisation than the default (0.02) gives
    # peaked, prompt-dependent distributions, so sampling tests see variety.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, init_std)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def ensure_tiny_model(path: str | os.PathLike | None = None) -> Path:
    """The tiny model's directory, built once (atomically: build, then rename)."""
    target = Path(path) if path else default_model_dir()
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build_tiny_model(staging)
        (staging / "rolloutflow.json").write_text(json.dumps({"recipe": RECIPE_VERSION}))
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("built the tiny model at %s", target)
    return target
