"""The flow's parameters model and the CLI that fills it: bad values are
rejected with the field named, before anything runs."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engines.sampling import SamplingParams
from flows.cli import parse_params
from flows.params import SAMPLED_WHEN_SET, RolloutParams


def test_defaults_are_the_embedded_demo():
    params = RolloutParams()
    assert params.prompts_path == "data/prompts.jsonl"
    assert params.model is None and params.address is None
    assert params.iterations == 1
    assert params.sampling().n == params.n and params.sampling().seed is None


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"num_engines": 0}, "num_engines"),
        ({"n": 0}, "n"),
        ({"top_p": 1.5}, "top_p"),
        ({"backend": "tpu"}, "backend"),
        ({"output_format": "csv"}, "output_format"),
        ({"shard_size": -1}, "shard_size"),
        ({"engine_retries": 99}, "engine_retries"),
        ({"num_engine": 2}, "num_engine"),  # a typo is not silently ignored
    ],
)
def test_invalid_values_name_the_field(values, field):
    with pytest.raises(ValidationError) as info:
        RolloutParams(**values)
    assert [error["loc"] for error in info.value.errors()] == [(field,)]


def test_max_tokens_must_leave_room_for_the_prompt():
    with pytest.raises(ValidationError, match=r"max_tokens \(64\) must be below max_len \(64\)"):
        RolloutParams(max_len=64, max_tokens=64)


def test_colocate_needs_a_policy_and_one_gpu_per_engine():
    RolloutParams(colocate=True, reward="training.letter_task:reward")
    with pytest.raises(ValidationError, match="colocate puts the policy beside the engines"):
        RolloutParams(colocate=True)
    with pytest.raises(ValidationError, match="it needs an on-policy run"):
        RolloutParams(colocate=True, reward="training.letter_task:reward", train=False)
    with pytest.raises(ValidationError, match="tensor_parallel_size must be 1, got 2"):
        RolloutParams(colocate=True, reward="training.letter_task:reward", tensor_parallel_size=2)


def test_schedule_and_its_staleness_bound():
    assert (RolloutParams().schedule, RolloutParams().staleness_bound) == ("sync", 0)
    assert RolloutParams(schedule="overlap").staleness_bound == 1
    assert RolloutParams(schedule="in_flight", max_staleness=3).staleness_bound == 3
    with pytest.raises(ValidationError, match=r"'overlap' needs max_staleness >= 1, got 0"):
        RolloutParams(schedule="overlap", max_staleness=0)
    with pytest.raises(ValidationError, match=r"max_staleness \(2\) needs schedule 'overlap'"):
        RolloutParams(max_staleness=2)
    with pytest.raises(ValidationError) as info:
        RolloutParams(schedule="async")
    assert [error["loc"] for error in info.value.errors()] == [("schedule",)]
    params = parse_params(["--schedule", "in_flight", "--max-staleness", "2"])
    assert (params.schedule, params.max_staleness) == ("in_flight", 2)


def test_json_schema_carries_bounds_for_the_ui():
    schema = RolloutParams.model_json_schema()
    assert schema["additionalProperties"] is False
    assert schema["properties"]["num_engines"]["minimum"] == 1
    assert schema["properties"]["backend"]["enum"] == ["auto", "vllm", "hf"]


def test_cli_flags_override_the_config_file(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"num_engines": 3, "n": 2, "address": "10.0.0.1:6379"}))
    params = parse_params(["--config", str(config), "--n", "4", "--address", "none"])
    assert (params.num_engines, params.n, params.address) == (3, 4, None)


def test_cli_reads_yaml(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("num_engines: 1\nignore_eos: true\n")
    params = parse_params(["--config", str(config)])
    assert params.num_engines == 1 and params.ignore_eos is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-engines", "zero"], "--num-engines 'zero'"),
        (["--temperature", "-1"], "--temperature '-1'"),
    ],
)
def test_cli_rejects_bad_flags_naming_the_field(argv, message):
    with pytest.raises(SystemExit) as info:
        parse_params(argv)
    assert "invalid parameters" in str(info.value.code)
    assert message in str(info.value.code)


def test_cli_rejects_a_config_that_is_not_a_mapping(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("- 1\n- 2\n")
    with pytest.raises(SystemExit, match="must hold a mapping"):
        parse_params(["--config", str(config)])


#: A non-default value of each of vLLM's per-request fields.
SAMPLING_VALUES = {
    "stop": ["\n", "###"],
    "stop_token_ids": [2, 7],
    "include_stop_str_in_output": True,
    "min_tokens": 3,
    "min_p": 0.05,
    "repetition_penalty": 1.2,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "skip_special_tokens": False,
}


@pytest.mark.parametrize(("name", "value"), SAMPLING_VALUES.items())
def test_sampling_fields_reach_sampling_params_or_fail_naming_the_field(name, value):
    """Every field set on the run reaches `SamplingParams`; one that our
    `SamplingParams` does not have (yet) is refused with its name, never
    dropped."""
    params = RolloutParams(**{name: value})
    if name in SamplingParams.model_fields:
        assert getattr(params.sampling(), name) == value
    else:
        with pytest.raises(ValidationError, match=name):
            params.sampling()


def test_unset_sampling_fields_keep_vllms_defaults():
    assert RolloutParams().sampling().model_fields_set == {
        "n",
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "ignore_eos",
        "logprobs",
    }


def test_every_sampling_field_has_a_flag():
    assert set(SAMPLING_VALUES) == set(SAMPLED_WHEN_SET)
    params = parse_params(
        ["--stop", "###", "--stop-token-ids", "[2, 7]", "--min-p", "0.05", "--min-tokens", "3"]
    )
    assert (params.stop, params.stop_token_ids, params.min_p) == (["###"], [2, 7], 0.05)
    assert parse_params(["--stop", '["a", "b"]']).stop == ["a", "b"]
    assert RolloutParams(stop="x").stop == ["x"]  # vLLM takes one string too


def test_task_fields_from_flags():
    params = parse_params(
        ["--label-field", "reward_model.ground_truth", "--id-field", "uid"]
        + ["--apply-chat-template", "--reward-style", "verl"]
    )
    assert params.label_field == "reward_model.ground_truth"
    assert (params.id_field, params.apply_chat_template, params.reward_style) == (
        "uid",
        True,
        "verl",
    )
    with pytest.raises(SystemExit, match="--reward-style"):
        parse_params(["--reward-style", "trl"])
