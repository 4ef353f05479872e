"""The flow's parameters model and the CLI that fills it: bad values are
rejected with the field named, before anything runs."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engines.sampling import SamplingParams
from flows.arguments import parse_params
from flows.params import FLAG_PAIRS, NEEDS_POLICY, RolloutParams, flag, sectioned
from flows.sampling import SAMPLED_WHEN_SET, SamplingSection

REWARD = "training.letter_task:reward"
AGENT = "agents.tool_task:agent"


def params(**values) -> RolloutParams:
    """Parameters from fields given by name (the flags' names)."""
    return RolloutParams.model_validate(sectioned(values))


def test_defaults_are_the_embedded_demo():
    defaults = RolloutParams()
    assert defaults.data.prompts_path == "data/prompts.jsonl"
    assert defaults.engines.model is None and defaults.cluster.address is None
    assert defaults.training.iterations == 1
    sampling = defaults.sampling.request()
    assert sampling.n == defaults.sampling.n and sampling.seed is None


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
    ],
)
def test_invalid_values_name_the_field(values, field):
    with pytest.raises(ValidationError) as info:
        RolloutParams.model_validate(sectioned(values))
    assert [error["loc"][-1] for error in info.value.errors()] == [field]


def test_a_typo_is_not_silently_ignored():
    with pytest.raises(ValidationError) as info:
        RolloutParams.model_validate({"engines": {"num_engine": 2}})
    assert [error["loc"] for error in info.value.errors()] == [("engines", "num_engine")]


def test_the_flat_shape_names_each_field_s_new_place():
    with pytest.raises(ValidationError) as info:
        RolloutParams.model_validate({"num_engines": 4, "n": 2, "output": {"shard_size": 4}})
    message = str(info.value)
    assert "num_engines -> engines.num_engines, n -> sampling.n" in message


def test_max_tokens_must_leave_room_for_the_prompt():
    with pytest.raises(ValidationError, match=r"max_tokens \(64\) must be below max_len \(64\)"):
        params(max_len=64, max_tokens=64)


def test_schedule_and_its_staleness_bound():
    training = RolloutParams().training
    assert (training.schedule, training.staleness_bound) == ("sync", 0)
    assert params(schedule="overlap", reward=REWARD).training.staleness_bound == 1
    in_flight = params(schedule="in_flight", max_staleness=3, reward=REWARD).training
    assert in_flight.staleness_bound == 3
    with pytest.raises(ValidationError, match=r"'overlap' needs max_staleness >= 1, got 0"):
        params(schedule="overlap", max_staleness=0, reward=REWARD)
    with pytest.raises(ValidationError) as info:
        params(schedule="async")
    assert [error["loc"] for error in info.value.errors()] == [("training", "schedule")]
    training = parse_params(["--schedule", "in_flight", "--max-staleness", "2"]).training
    assert (training.schedule, training.max_staleness) == ("in_flight", 2)
    # partial: the bound is how many iterations a group may wait.
    partial = params(schedule="partial", max_staleness=4, partial_in_flight=2.0, reward=REWARD)
    assert (partial.training.staleness_bound, partial.training.partial_in_flight) == (4, 2.0)
    with pytest.raises(ValidationError, match="partial_in_flight"):
        params(schedule="partial", partial_in_flight=2.5, reward=REWARD)


def test_json_schema_carries_bounds_for_the_ui():
    schema = RolloutParams.model_json_schema()
    assert schema["additionalProperties"] is False
    engines = schema["$defs"]["EngineParams"]
    assert engines["additionalProperties"] is False
    assert engines["properties"]["num_engines"]["minimum"] == 1
    assert engines["properties"]["backend"]["enum"] == ["auto", "vllm", "hf"]


def test_one_declaration_of_each_sampling_bound():
    """The run's sampling fields are `SamplingParams`' own: the same bounds
    in the run form as in the engine's requests."""
    run, engine = SamplingSection.model_fields, SamplingParams.model_fields
    shared = set(run) & set(engine) - {"seed"}  # the run's base seed is its own field
    assert len(shared) == 16
    for name in shared:
        assert run[name].metadata == engine[name].metadata, name
    schema = RolloutParams.model_json_schema()["$defs"]["SamplingSection"]["properties"]
    assert schema["temperature"]["minimum"] == 0 and "maximum" not in schema["temperature"]
    assert schema["top_p"]["exclusiveMinimum"] == 0 and schema["top_p"]["maximum"] == 1


def test_cli_flags_override_the_config_file(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(
        json.dumps(
            {
                "engines": {"num_engines": 3},
                "sampling": {"n": 2},
                "cluster": {"address": "10.0.0.1:6379"},
            }
        )
    )
    run = parse_params(["--config", str(config), "--n", "4", "--address", "none"])
    assert (run.engines.num_engines, run.sampling.n, run.cluster.address) == (3, 4, None)
    assert run.sampling.max_tokens == 8  # the demo preset's, under the file


def test_cli_reads_yaml(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("engines:\n  num_engines: 1\nsampling:\n  ignore_eos: true\n")
    run = parse_params(["--config", str(config)])
    assert run.engines.num_engines == 1 and run.sampling.ignore_eos is True


def test_cli_refuses_a_config_of_the_flat_shape_naming_the_new_places(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("num_engines: 1\nignore_eos: true\n")
    with pytest.raises(SystemExit) as info:
        parse_params(["--config", str(config)])
    assert "num_engines -> engines.num_engines, ignore_eos -> sampling.ignore_eos" in str(
        info.value.code
    )


def test_a_bad_value_in_the_config_is_named_by_its_place(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("engines:\n  num_engines: 0\n")
    with pytest.raises(SystemExit) as info:
        parse_params(["--config", str(config)])
    assert f"engines.num_engines in {config} 0:" in str(info.value.code)


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
    run = params(**{name: value})
    if name in SamplingParams.model_fields:
        assert getattr(run.sampling.request(), name) == value
    else:
        with pytest.raises(ValidationError, match=name):
            run.sampling.request()


def test_unset_sampling_fields_keep_vllms_defaults():
    assert RolloutParams().sampling.request().model_fields_set == {
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
    sampling = parse_params(
        ["--stop", "###", "--stop-token-ids", "[2, 7]", "--min-p", "0.05", "--min-tokens", "3"]
    ).sampling
    assert (sampling.stop, sampling.stop_token_ids, sampling.min_p) == (["###"], [2, 7], 0.05)
    assert parse_params(["--stop", '["a", "b"]']).sampling.stop == ["a", "b"]
    assert params(stop="x").sampling.stop == ["x"]  # vLLM takes one string too


def test_task_fields_from_flags():
    run = parse_params(
        ["--label-field", "reward_model.ground_truth", "--id-field", "uid"]
        + ["--apply-chat-template", "--reward-style", "verl"]
    )
    assert run.data.label_field == "reward_model.ground_truth"
    assert (run.data.id_field, run.data.apply_chat_template, run.training.reward_style) == (
        "uid",
        True,
        "verl",
    )
    with pytest.raises(SystemExit, match="--reward-style"):
        parse_params(["--reward-style", "trl"])


def test_the_run_form_shows_the_sections_only():
    """The flow's `early` argument (the CLI's engines) is no run setting: the
    deployment form and the server's schema check see `params` alone."""
    from prefect.utilities.callables import parameter_schema

    from flows.rollout import rollout

    schema = parameter_schema(rollout.fn)
    assert list(schema.properties) == ["params"]
    sections = schema.definitions["RolloutParams"]["properties"]
    assert list(sections) == [
        "data",
        "engines",
        "sampling",
        "training",
        "agents",
        "output",
        "cluster",
    ]


def test_an_agent_gives_the_reward_and_trains():
    run = params(agent=AGENT)
    assert run.agents.agentic and run.on_policy


def test_agent_runs_have_a_section_of_their_own_and_keep_their_flags(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("agents:\n  agent_timeout_s: 30\n")
    run = parse_params(["--config", str(config), "--agent", "agents.tool_task:agent"])
    assert (run.agents.agent, run.agents.agent_timeout_s) == ("agents.tool_task:agent", 30.0)
    assert parse_params(["--agent-func-path", "f.py"]).agents.agent_func_path == "f.py"
    with pytest.raises(ValidationError, match=r"agent -> agents\.agent"):
        RolloutParams.model_validate({"agent": "agents.tool_task:agent"})


def test_cli_agent_runs_leave_the_demo_reward_out():
    run = parse_params(["--agent", "agents.tool_task:agent"])
    assert run.training.reward is None and run.training.iterations == 6
    assert parse_params([]).training.reward == "training.letter_task:reward"


#: A non-default value of each sampling field an `--agent` run's sessions do not take.
AGENT_UNSAMPLED_VALUES = {"top_p": 0.9, "top_k": 5, "ignore_eos": True, "logprobs": 0}
AGENT_UNSAMPLED_VALUES.update(SAMPLING_VALUES)

#: Every refused pair: a run giving it (and nothing else refused), and the
#: two flags its message names.
REFUSED = [
    ({"agent": AGENT, "reward": REWARD}, "--agent", "--reward"),
    ({"agent_func_path": "f.py", "reward": REWARD}, "--agent-func-path", "--reward"),
    ({"agent_func_path": "f.py", "agent": AGENT}, "--agent-func-path", "--agent"),
    ({"colocate": True}, "--colocate", "--reward"),
    ({"colocate": True, "reward": REWARD, "train": False}, "--colocate", "--no-train"),
    ({"schedule": "overlap"}, "--schedule overlap", "--reward"),
    ({"dynamic_sampling": True, "n": 2}, "--dynamic-sampling", "--reward"),
    ({"learning_rate": 0.1}, "--learning-rate 0.1", "--reward"),
    ({"micro_batch_tokens": 512}, "--micro-batch-tokens 512", "--reward"),
    ({"compute_dtype": "bfloat16"}, "--compute-dtype bfloat16", "--reward"),
    ({"weight_sync_probe": False}, "--no-weight-sync-probe", "--reward"),
    ({"train": False}, "--no-train", "--reward"),
    (
        {"colocate": True, "reward": REWARD, "tensor_parallel_size": 2},
        "--colocate",
        "--tensor-parallel-size",
    ),
    ({"dynamic_sampling": True, "reward": REWARD, "n": 1}, "--dynamic-sampling", "--n"),
    (
        {"dynamic_sampling": True, "reward": REWARD, "n": 2, "schedule": "partial"},
        "--dynamic-sampling",
        "--schedule partial",
    ),
    ({"max_refill_rounds": 5, "reward": REWARD}, "--max-refill-rounds 5", "--dynamic-sampling"),
    ({"max_staleness": 2, "reward": REWARD}, "--max-staleness 2", "--schedule"),
    ({"partial_in_flight": 2.0, "reward": REWARD}, "--partial-in-flight 2.0", "--schedule partial"),
    (
        {"partial_keep_generating": False, "reward": REWARD, "schedule": "overlap"},
        "--no-partial-keep-generating",
        "--schedule partial",
    ),
    (
        {"partial_start_next": True, "reward": REWARD, "schedule": "sync"},
        "--partial-start-next",
        "--schedule partial",
    ),
    (
        {
            "partial_start_next": True,
            "partial_keep_generating": False,
            "reward": REWARD,
            "schedule": "partial",
        },
        "--partial-start-next",
        "--partial-keep-generating",
    ),
    ({"agent": AGENT, "schedule": "partial"}, "--agent", "--schedule partial"),
    ({"agent_func_path": "f.py", "schedule": "partial"}, "--agent-func-path", "--schedule partial"),
    (
        {"shard_size": 4, "reward": REWARD, "schedule": "partial"},
        "--shard-size 4",
        "--schedule partial",
    ),
    (
        {"shards_per_engine": 2, "reward": REWARD, "schedule": "partial"},
        "--shards-per-engine 2",
        "--schedule partial",
    ),
    ({"reward_style": "verl"}, "--reward-style verl", "--reward"),
    ({"reward_timeout_s": 60, "agent": AGENT}, "--reward-timeout-s 60", "--reward"),
    ({"agent_timeout_s": 30}, "--agent-timeout-s 30", "--agent"),
    *(
        (
            {name: value, "agent": AGENT},
            flag(name if value is not False else f"no_{name}"),
            "--agent",
        )
        for name, value in AGENT_UNSAMPLED_VALUES.items()
    ),
    ({"tool_call_parser": "hermes"}, "--tool-call-parser hermes", "--openai-api"),
    ({"local_num_cpus": 4, "address": "10.0.0.1:6379"}, "--local-num-cpus 4", "--address"),
]

#: The same flags where they work.
ACCEPTED = [
    {"agent": AGENT},
    {"agent_func_path": "f.py", "agent_timeout_s": 30, "top_p": 0.9, "ignore_eos": True},
    {"colocate": True, "reward": REWARD, "spare_engines": 1},
    {"schedule": "overlap", "agent": AGENT, "learning_rate": 0.1, "micro_batch_tokens": 512},
    {"dynamic_sampling": True, "max_refill_rounds": 5, "reward": REWARD, "n": 2},
    {"dynamic_sampling": True, "agent": AGENT, "n": 2, "schedule": "in_flight"},
    {"train": False, "reward": REWARD, "reward_style": "verl", "reward_timeout_s": 60},
    {"train": False, "agent": AGENT},
    {"weight_sync_probe": False, "reward": REWARD},
    {"schedule": "partial", "reward": REWARD, "partial_in_flight": 2.0, "n": 4},
    {"schedule": "partial", "reward": REWARD, "partial_keep_generating": False},
    {"schedule": "partial", "reward": REWARD, "partial_start_next": True, "max_staleness": 2},
    {"schedule": "in_flight", "reward": REWARD, "max_staleness": 2, "shard_size": 4},
    {"agent": AGENT, "max_tokens": 12, "temperature": 0.3, "n": 4, "seed": 7},
    {"tool_call_parser": "hermes", "openai_api": True},
    {"tool_call_parser": "hermes", "agent": AGENT},
    {"local_num_cpus": 4},
    # A run form or a config file that spells out a default gives nothing.
    {"partial_in_flight": 1.5, "shard_size": 16, "schedule": "partial", "reward": REWARD},
]


def unchecked(values: dict) -> RolloutParams:
    """The run of `values`, each section checked, not the run's pairs."""
    given = sectioned(values)
    return RolloutParams.model_construct(
        **{
            name: info.annotation.model_validate(given.get(name, {}))
            for name, info in RolloutParams.model_fields.items()
        }
    )


@pytest.mark.parametrize(("values", "first", "second"), REFUSED)
def test_a_flag_pair_is_refused_naming_both(values, first, second):
    """Each row is refused by its own rule alone: without it, the run passes."""
    assert [p for p in FLAG_PAIRS if p.refuses(unchecked(values))], values
    with pytest.raises(ValidationError) as info:
        params(**values)
    (error,) = info.value.errors()
    (message,) = error["msg"].removeprefix("Value error, ").splitlines()
    assert message.startswith(first) and second in message.removeprefix(first), message


def test_every_flag_pair_has_its_refused_row():
    rows = [unchecked(values) for values, _, _ in REFUSED]
    untested = [p for p in FLAG_PAIRS if not any(p.refuses(run) for run in rows)]
    assert untested == []


@pytest.mark.parametrize("values", ACCEPTED)
def test_the_same_flags_work_where_they_mean_something(values):
    run = params(**values)
    assert all(run.value(name) == value for name, value in values.items())


def test_the_cli_lists_every_clash_on_a_line_of_its_own():
    with pytest.raises(SystemExit) as info:
        parse_params(["--plain", "--learning-rate", "0.1", "--agent-timeout-s", "9"])
    assert str(info.value.code).splitlines() == [
        "error: invalid parameters",
        f"  parameters: --learning-rate 0.1 {NEEDS_POLICY}",
        "  parameters: --agent-timeout-s 9.0 needs --agent or --agent-func-path: it is an "
        "agent session's deadline",
    ]


def test_the_demo_preset_leaves_out_what_a_given_flag_makes_meaningless():
    """The preset's step size would clash with --no-train (an evaluation of
    the demo task), its reward with --agent; what the user typed still clashes."""
    evaluation = parse_params(["--no-train"])
    assert evaluation.training.reward == REWARD and not evaluation.on_policy
    assert evaluation.training.learning_rate == 1e-5  # the field's default
    with pytest.raises(SystemExit, match="--learning-rate 0.1 needs a policy"):
        parse_params(["--no-train", "--learning-rate", "0.1"])
