"""The agent-replay benchmark's trace and its fit to the engines' max length,
checked before any engine starts (no engines here)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from agent_replay import TRACES, TraceTooLongError, check_fits  # noqa: E402
from endpoint_engines import add_engine_arguments, max_len  # noqa: E402


def engine_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_8b_shape_has_llama_3_8bs_positions_and_both_traces_fit_them():
    positions = max_len(engine_args("--shape", "8b"))
    assert positions == 8192
    assert max_len(engine_args("--shape", "8b", "--max-len", "2048")) == 2048
    assert max_len(engine_args("--backend", "hf")) == 4096
    for trace in TRACES.values():
        check_fits(trace, positions)


def test_a_trace_past_the_max_length_is_refused_naming_the_numbers():
    # the coding trace on the 8B shape's old 4,096 positions: an HTTP 400 mid-run before
    with pytest.raises(TraceTooLongError, match=r"session 0's last turn needs 7992 .* have 4096"):
        check_fits(TRACES["coding"], 4096)


def test_the_coding_trace_spreads_tool_lengths_and_every_session_sends_the_same():
    trace = TRACES["coding"]
    lengths = [trace.tool_lengths(s) for s in range(trace.sessions)]
    assert {min(x) for x in lengths} == {256} and {max(x) for x in lengths} == {512}
    assert {sum(x) for x in lengths} == {16 * 384}
    assert len({tuple(x) for x in lengths}) == trace.sessions  # each its own order
    assert lengths == [trace.tool_lengths(s) for s in range(trace.sessions)]  # seeded
    messages = trace.messages(3, ["a", "b"])
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 2 + ["user"]
    assert [len(m["content"]) for m in messages[1::2]] == lengths[3][:3]
