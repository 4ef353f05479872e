"""The schedules benchmark's set-up (benchmarks/schedules.py): the GPU
model it builds holds the long tail's longest sequence, which vLLM
requires of its max_len."""

from __future__ import annotations

import json

from benchmarks import schedules
from engines import tiny_model


def test_the_gpu_model_holds_the_long_tails_longest_sequence(tmp_path, monkeypatch):
    built = {}

    def build(path, **shape):
        built.update(shape)
        return path

    monkeypatch.setattr(tiny_model, "build_tiny_model", build)
    args = schedules.parse_args(["--workload", "long-tail", "--scale", "1", "--gpu-model"])
    schedules.write_prompts(args, tmp_path)
    schedules.build_model(args, tmp_path)
    assert schedules.max_len(args) > 4096  # 8,192 tokens at --scale 1
    assert built["max_positions"] >= schedules.max_len(args)


def test_a_tiny_model_takes_its_max_positions(tmp_path):
    path = tiny_model.build_tiny_model(tmp_path / "model", max_positions=8320)
    config = json.loads((path / "config.json").read_text())
    assert config["max_position_embeddings"] == 8320
