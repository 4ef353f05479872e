"""The CPU backend's OpenAI routes (engines/hf/openai/: the app, chat,
completions) on a real engine actor, over real HTTP with the real `openai`
client: completions (text and token ids), chat, logprobs in OpenAI's shape,
`return_token_ids`, usage, models, tokenize/detokenize, tool calls, and bad
requests answered with vLLM's errors naming the field, the engine still
serving."""

from __future__ import annotations

import httpx
import openai
import pytest
import ray
from waiting import SETUP_TIMEOUT_S

from engines import create_vllm_engines, destroy_engines

MAX_LEN = 128
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engines(ray_local_module, tiny_model):
    engines = create_vllm_engines(
        1,
        tiny_model,
        MAX_LEN,
        backend="hf",
        name_prefix="test-openai-app",
        openai_api=True,
        tool_call_parser="hermes",
    )
    yield engines
    destroy_engines(engines)


@pytest.fixture(scope="module")
def url(engines) -> str:
    # The engine's start first, on the set-up deadline (a loaded box, -n 2).
    ray.get(engines[0].ready.remote(), timeout=SETUP_TIMEOUT_S)
    return ray.get(engines[0].openai_url.remote(), timeout=60)


@pytest.fixture(scope="module")
def api(engines, url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=engines.api_key, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def post(engines, url):
    """A raw POST to a route (the status and vLLM's error JSON as sent)."""
    root = url.removesuffix("/v1")

    def send(path: str, body: dict) -> httpx.Response:
        headers = {"Authorization": f"Bearer {engines.api_key}"}
        return httpx.post(root + path, json=body, headers=headers, timeout=120)

    return send


def test_completions_from_text_and_from_token_ids(api, post, tiny_model):
    ids = post("/tokenize", {"prompt": "hello"}).json()["tokens"]
    text = api.completions.create(
        model=tiny_model, prompt="hello", max_tokens=6, logprobs=2, **GREEDY
    )
    (choice,) = text.choices
    assert choice.prompt_token_ids == ids and len(choice.token_ids) == 6
    assert choice.finish_reason == "length" and choice.token_versions == [0] * 6
    assert choice.text == post("/detokenize", {"tokens": choice.token_ids}).json()["prompt"]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    usage = text.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 6, 11)
    assert usage.prompt_tokens_details.cached_tokens == 0
    same = api.completions.create(model=None, prompt=ids, max_tokens=6, **GREEDY)
    assert same.choices[0].token_ids == choice.token_ids


def test_a_batch_of_token_prompts_n_samples_and_seeds(api):
    prompts = [[42, 71, 78], [30, 31, 32, 33]]
    sampled = {"max_tokens": 5, "n": 2, "seed": 7, "extra_body": {"return_token_ids": True}}
    answer = api.completions.create(model=None, prompt=prompts, **sampled)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [c.prompt_token_ids for c in answer.choices] == [prompts[0]] * 2 + [prompts[1]] * 2
    again = api.completions.create(model=None, prompt=prompts, **sampled)
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in answer.choices]
    assert answer.usage.prompt_tokens == 7 and answer.usage.completion_tokens == sum(
        len(c.token_ids) for c in answer.choices
    )


def test_stop_strings_cut_the_text(api):
    free = api.completions.create(model=None, prompt="abc", max_tokens=10, **GREEDY).choices[0]
    stop = free.text[3:5]
    cut = api.completions.create(model=None, prompt="abc", max_tokens=10, stop=[stop], **GREEDY)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == stop
    assert cut.choices[0].text == free.text[: free.text.find(stop)]


def test_chat_renders_the_template_and_answers_with_logprobs(api, post):
    answer = api.chat.completions.create(
        model=None, messages=HI, max_completion_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    rendered = post("/tokenize", {"messages": HI}).json()["tokens"]
    assert answer.model_extra["prompt_token_ids"] == rendered
    (choice,) = answer.choices
    tokens = choice.model_extra["token_ids"]
    assert len(tokens) == 5 and choice.message.role == "assistant"
    content = choice.logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob <= c.top_logprobs[0].logprob + 1e-6 for c in content)
    assert answer.usage.prompt_tokens == len(rendered) and answer.usage.completion_tokens == 5
    # The same generation path as a completion of the rendered prompt.
    plain = api.completions.create(model=None, prompt=rendered, max_tokens=5, **GREEDY)
    assert plain.choices[0].token_ids == tokens
    assert answer.model_extra["weight_versions"] == [0]


def test_models_tokenize_and_detokenize(api, post, tiny_model):
    (card,) = api.models.list().data
    assert card.id == tiny_model and card.model_extra["max_model_len"] == MAX_LEN
    tokens = post("/tokenize", {"prompt": "héllo", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 6 and tokens["max_model_len"] == MAX_LEN
    assert len(tokens["token_strs"]) == 6
    assert post("/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}


def test_tools_reach_the_answer_as_tool_calls(api):
    auto = api.chat.completions.create(model=None, messages=HI, tools=TOOLS, max_tokens=6)
    message = auto.choices[0].message
    # The tiny model calls no tool: its text is the content, as vLLM's parser leaves it.
    assert not message.tool_calls and message.content is not None
    named = api.chat.completions.create(
        model=None,
        messages=HI,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=6,
        **GREEDY,
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function"


def test_streams_carry_the_same_answer_as_server_sent_events(api):
    ask = {"model": None, "messages": HI, "max_tokens": 6, "n": 2, "seed": 3}
    whole = api.chat.completions.create(**ask)
    raw = api.chat.completions.with_raw_response.create(
        **ask, stream=True, stream_options={"include_usage": True}
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["x-weight-versions"] == "0"
    text, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in raw.parse():
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        usage = chunk.usage or usage
    assert text == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    plain = api.completions.create(model=None, prompt="ab", max_tokens=4, **GREEDY)
    streamed = api.completions.create(model=None, prompt="ab", max_tokens=4, stream=True, **GREEDY)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[0].choices[0].token_ids == plain.choices[0].token_ids


BAD = [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model", "`nope` does not exist"),
    (
        "/v1/chat/completions",
        {"messages": [*HI, {"role": "robot", "content": "x"}]},
        400,
        "messages.1.role",
        "robot",
    ),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages.0.role", "role"),
    ("/v1/chat/completions", {"model": "x"}, 400, "messages", "messages"),
    ("/v1/completions", {"prompt": "x" * MAX_LEN}, 400, "prompt", "maximum context length"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x" * MAX_LEN}]},
        400,
        "messages",
        "maximum context length",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "tools": TOOLS, "tool_choice": {"function": {"name": "rm_rf"}}},
        400,
        "tool_choice",
        "rm_rf",
    ),
    ("/v1/completions", {"prompt": [5, 999]}, 400, "prompt", "999"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "echo"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "said"), BAD)
def test_bad_requests_get_vllms_errors_naming_the_field(api, post, path, body, status, param, said):
    answer = post(path, body)
    error = answer.json()["error"]
    assert answer.status_code == error["code"] == status
    assert param in error["param"] and said in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    # The engine still serves.
    assert api.completions.create(model=None, prompt="hi", max_tokens=2).choices


def test_history_tool_calls_reach_the_template_as_objects_as_vllm_sends_them():
    from engines.hf.openai import protocol as p
    from engines.hf.openai.chat import chat_message
    from engines.hf.openai.errors import OpenAIError

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    said = p.ChatMessageParam(role="assistant", content=None, tool_calls=[call])
    assert chat_message(said) == {
        "role": "assistant",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
        ],
    }
    parts = p.ChatMessageParam(
        role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    )
    assert chat_message(parts) == {"role": "user", "content": "ab"}
    bad = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not"}}
    with pytest.raises(OpenAIError, match="arguments are not JSON"):
        chat_message(p.ChatMessageParam(role="assistant", tool_calls=[bad]))
