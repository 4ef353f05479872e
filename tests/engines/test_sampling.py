"""`SamplingParams` behaves as vLLM's (vllm/sampling_params.py, v0.26.0):
checked at construction, any assignment accepted, checked again when a
request uses them, with vLLM's `_verify_args` messages naming the field; a
bad request leaves the engine serving."""

from __future__ import annotations

import asyncio
import copy

import pytest
from pydantic import ValidationError

from engines.config import EngineConfig
from engines.errors import RequestError
from engines.hf import HFEngine
from engines.sampling import SamplingParams

# (field, a value vLLM accepts on assignment and refuses for a request, its message)
BAD_VALUES = [
    ("max_tokens", -4, r"max_tokens must be at least 1, got -4\."),
    ("max_tokens", 0, r"max_tokens must be at least 1, got 0\."),
    ("n", 0, r"n must be at least 1, got 0\."),
    ("temperature", -0.5, r"temperature must be non-negative, got -0\.5\."),
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0\.0\."),
    ("top_k", -2, r"top_k must be 0 \(disable\), or at least 1, got -2\."),
    ("min_p", 1.5, r"min_p must be in \[0, 1\], got 1\.5\."),
    ("presence_penalty", 3.0, r"presence_penalty must be in \[-2, 2\], got 3\.0\."),
    ("frequency_penalty", -3.0, r"frequency_penalty must be in \[-2, 2\], got -3\.0\."),
    ("repetition_penalty", 0.0, r"repetition_penalty must be greater than zero, got 0\.0\."),
    ("min_tokens", -1, r"min_tokens must be greater than or equal to 0, got -1\."),
    ("min_tokens", 20, r"min_tokens must be less than or equal to max_tokens=16, got 20\."),
    ("logprobs", -3, r"logprobs must be non-negative, got -3\."),
    ("stop", [""], r"stop cannot contain an empty string\."),
    # A value of the wrong type: named, where vLLM fails comparing it.
    ("temperature", "hot", r"temperature must be float, got 'hot'\."),
    ("stop_token_ids", "x", r"stop_token_ids='x': Input should be a valid list"),
    # A vLLM field the engines do not honour: assignable, refused by name.
    ("bad_words", ["x"], r"unsupported sampling parameters \['bad_words'\]"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD_VALUES)
def test_assignment_is_accepted_and_checked_at_request_time(name, value, message):
    params = SamplingParams()
    setattr(params, name, value)  # vLLM's SamplingParams takes any assignment
    assert getattr(params, name) == value
    assert getattr(copy.deepcopy(params), name) == value  # OpenRLHF deep-copies per turn
    with pytest.raises(RequestError, match=message):
        params.verify()
    with pytest.raises(RequestError, match=message):
        SamplingParams.coerce(params)  # what the CPU backend calls per request


def test_openrlhf_multi_turn_budget_check():
    """utils/agent.py, MultiTurnAgentExecutor.execute: the budget is assigned,
    then compared, before any request."""
    sampling_params = SamplingParams(max_tokens=8)
    max_length, current_obs_tokens = 60, list(range(64))
    sampling_params.max_tokens = max_length - len(current_obs_tokens)
    assert sampling_params.max_tokens <= 0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_tokens": -4}, "max_tokens"),
        ({"n": 0}, "n"),
        (
            {"min_tokens": 5, "max_tokens": 3},
            "min_tokens must be less than or equal to max_tokens=3",
        ),
        ({"stop": ["", "x"]}, "stop cannot contain an empty string"),
        ({"bad_words": ["x"]}, r"unsupported sampling parameters \['bad_words'\]"),
    ],
)
def test_construction_is_checked_as_vllms(values, message):
    """vLLM runs `_verify_args` in `__post_init__`: a bad value is refused at
    construction too, and a dict given for a request the same, as RequestError."""
    with pytest.raises(ValidationError, match=message):
        SamplingParams(**values)
    with pytest.raises(RequestError, match=message):
        SamplingParams.coerce(values)


def test_good_params_pass_and_vllm_like_objects_are_checked():
    params = SamplingParams(max_tokens=4, stop="x")
    params.max_tokens = 5
    params.verify()
    assert SamplingParams.coerce(params) is params

    class VllmLike:  # vllm.SamplingParams after an assignment
        n, temperature, max_tokens = 1, 0.0, -1

    with pytest.raises(RequestError, match="max_tokens must be at least 1, got -1"):
        SamplingParams.coerce(VllmLike())


def test_the_engine_refuses_the_request_and_keeps_serving(tiny_model):
    config = EngineConfig(
        name="sampling", pretrain=tiny_model, max_len=64, seed=0, rpc_timeout_s=30
    )
    engine = HFEngine(config)
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        params.max_tokens = -4
        with pytest.raises(RequestError, match=r"max_tokens must be at least 1, got -4\."):
            asyncio.run(engine.generate([5, 6, 7], params))
        params.max_tokens = 3
        output = asyncio.run(engine.generate([5, 6, 7], params))
        assert len(output.outputs[0].token_ids) == 3
    finally:
        asyncio.run(engine.shutdown())
