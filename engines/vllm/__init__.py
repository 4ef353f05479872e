"""The GPU backend: vLLM's AsyncLLM in the engine actor (`VLLMEngine`).

Importing it does not import vLLM: the engine actor does, as it starts
(`engines.vllm.api`)."""

from engines.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine"]
