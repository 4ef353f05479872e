"""vLLM's own split of an engine's start-up (weights, torch.compile, CUDA
graphs, ...), read from the log lines its engine core writes into the actor's
log files.
"""

from __future__ import annotations

import os
import re

from engines.startup import Phase

# vLLM 0.26.0's start-up log lines (the engine core and its GPU worker):
# model_loader/default_loader.py, v1/worker/gpu_model_runner.py,
# compilation/backends.py and monitor.py, v1/engine/core.py.
VLLM_LOG_PHASES = (
    ("weight load", re.compile(r"Loading weights took ([\d.]+) seconds")),
    ("model load (weights included)", re.compile(r"Model loading took .*? and ([\d.]+) seconds")),
    ("dynamo bytecode transform", re.compile(r"Dynamo bytecode transform time: ([\d.]+) s")),
    ("torch.compile (total)", re.compile(r"torch\.compile took ([\d.]+) s in total")),
    ("CUDA graph capture", re.compile(r"Graph capturing finished in ([\d.]+) secs")),
    (
        "profile + KV cache + warm-up (compile and graphs included)",
        re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    ),
)
#: Loaded from the compile cache instead of compiled (a warm start).
VLLM_CACHE_HIT = re.compile(r"Directly load the compiled graph")


def vllm_log_phases(text: str) -> tuple[Phase, ...]:
    """vLLM's start-up split from its log text (the first match of each line:
    with TP>1 every rank logs its own)."""
    phases = []
    for name, pattern in VLLM_LOG_PHASES:
        match = pattern.search(text)
        if match:
            phases.append(Phase(name, float(match.group(1))))
    if VLLM_CACHE_HIT.search(text):
        phases.append(Phase("compiled graphs loaded from the cache", 0.0))
    return tuple(phases)


class OwnLog:
    """This process's stdout and stderr when they are files (a Ray worker's
    log files, which vLLM's engine-core child process inherits), read from
    where they stood at construction: what the engine logged since."""

    def __init__(self) -> None:
        self.starts: dict[str, int] = {}
        for fd in (1, 2):
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # not Linux, or closed
                continue
            if os.path.isfile(path):
                self.starts[path] = os.path.getsize(path)

    def read(self, limit: int = 4 << 20) -> str:
        chunks = []
        for path, start in self.starts.items():
            try:
                with open(path, errors="replace") as f:
                    f.seek(start)
                    chunks.append(f.read(limit))
            except OSError:
                continue
        return "\n".join(chunks)
