"""vLLM's start-up split read from its log lines (engines/vllm/startup_log.py)."""

from __future__ import annotations

from engines.vllm.startup_log import vllm_log_phases

# vLLM 0.26.0's lines as an engine core writes them (Ray's and vLLM's prefixes included).
P = "(EngineCore pid=812) INFO 11-30 10:00:01"
VLLM_LOG = f"""\
{P} [default_loader.py:431] Loading weights took 0.42 seconds
{P} [gpu_model_runner.py:5348] Model loading took 0.53 GiB memory and 1.250000 seconds
{P} [backends.py:1156] Dynamo bytecode transform time: 5.10 s
{P} [backends.py:293] Directly load the compiled graph(s) for compile range (1, 8192) \
from the cache, took 1.2 s
{P} [monitor.py:20] torch.compile took 7.31 s in total
{P} [gpu_model_runner.py:6845] Graph capturing finished in 8 secs, took 0.31 GiB
{P} [core.py:341] init engine (profile, create kv cache, warmup model) took 18.04 s \
(compilation: 7.31 s)
"""


def test_vllm_log_phases_reads_each_line_once():
    phases = {p.name: p.seconds for p in vllm_log_phases(VLLM_LOG)}
    assert phases == {
        "weight load": 0.42,
        "model load (weights included)": 1.25,
        "dynamo bytecode transform": 5.1,
        "torch.compile (total)": 7.31,
        "CUDA graph capture": 8.0,
        "profile + KV cache + warm-up (compile and graphs included)": 18.04,
        "compiled graphs loaded from the cache": 0.0,
    }
    assert vllm_log_phases("no vLLM here") == ()
