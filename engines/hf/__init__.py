"""The CPU backend: a transformers model in the engine actor (`HFEngine`).

Importing it imports neither torch nor transformers: the engine actor does,
as it starts."""

from engines.hf.engine import HFEngine

__all__ = ["HFEngine"]
