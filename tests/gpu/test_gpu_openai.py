"""The vLLM backend's OpenAI endpoint (engines/vllm/openai_app.py: vLLM's own
app in the engine actor) on a real engine, through the real `openai` client:
chat, completions from token ids with `return_token_ids`, logprobs, tokenize,
tool parsing, a weight sync during a running HTTP request (frozen, synced,
resumed; both versions named, each token's version) and bad requests answered
with vLLM's errors, the engine still serving. One engine, eager: ~2 minutes."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
from gpu_helpers import vllm_engine, wait_gpus_released, wait_ready
from waiting import wait_until

from engines import SamplingParams, destroy_engines

pytestmark = pytest.mark.gpu

MAX_LEN = 2048
TIMEOUT_S = 120
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
HI = [{"role": "user", "content": "hi"}]
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


@pytest.fixture(scope="module")
def engines(ray_gpu, gpu_model, gpu_baseline):
    engines = vllm_engine(
        gpu_model,
        "gpu-openai",
        max_len=MAX_LEN,
        enable_prefix_caching=True,
        openai_api=True,
        tool_call_parser="hermes",
    )
    try:
        wait_ready(engines, "one engine serving the OpenAI API")
        yield engines
    finally:
        destroy_engines(engines)
        wait_gpus_released(gpu_baseline)


@pytest.fixture(scope="module")
def url(ray_gpu, engines) -> str:
    url = ray_gpu.get(engines[0].openai_url.remote(), timeout=TIMEOUT_S)
    print(f"\nthe engine serves {url}")
    return url


@pytest.fixture(scope="module")
def api(engines, url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=engines.api_key, timeout=TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def post(engines, url):
    """A raw POST to a route: the status and vLLM's JSON as sent."""
    root = url.removesuffix("/v1")

    def send(path: str, body: dict) -> httpx.Response:
        headers = {"Authorization": f"Bearer {engines.api_key}"}
        return httpx.post(root + path, json=body, headers=headers, timeout=TIMEOUT_S)

    return send


def test_models_and_tokenize_are_vllms(api, post, gpu_model):
    (card,) = api.models.list().data
    assert card.id == gpu_model and card.model_extra["max_model_len"] == MAX_LEN
    tokens = post("/tokenize", {"prompt": "hello"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_LEN
    assert post("/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"].endswith("hello")


def test_completions_from_token_ids_match_the_actor_and_return_their_ids(
    ray_gpu, engines, api, post
):
    ids = post("/tokenize", {"prompt": "The quick brown fox"}).json()["tokens"]
    raw = api.completions.with_raw_response.create(
        model=None, prompt=ids, max_tokens=16, logprobs=2, **GREEDY
    )
    answer = raw.parse()
    (choice,) = answer.choices
    assert raw.headers["x-weight-versions"] == "0"
    assert choice.prompt_token_ids == ids and len(choice.token_ids) == 16
    assert choice.finish_reason == "length" and choice.token_versions == [0] * 16
    assert raw.http_response.json()["weight_versions"] == [0]
    logprobs = choice.logprobs
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 16
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    # The same tokens as a Ray `generate` on the same engine.
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    direct = ray_gpu.get(engines[0].generate.remote(ids, params), timeout=TIMEOUT_S)
    assert direct.outputs[0].token_ids == choice.token_ids
    # Prefix caching: the same prompt again reuses its blocks, and usage says so.
    again = api.completions.create(model=None, prompt=ids * 8, max_tokens=2, **GREEDY)
    cached = api.completions.create(model=None, prompt=ids * 8, max_tokens=2, **GREEDY)
    assert again.usage.prompt_tokens == cached.usage.prompt_tokens == len(ids) * 8
    assert cached.usage.prompt_tokens_details.cached_tokens > 0
    # A batch of token prompts with n: choices numbered prompt by prompt.
    prompts = [ids[:3], ids[3:7]]
    batch = api.completions.create(
        model=None, prompt=prompts, max_tokens=4, n=2, seed=7, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.prompt_token_ids for c in batch.choices] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert all(c.token_versions == [0] * len(c.token_ids) for c in batch.choices)


def test_chat_renders_the_template_and_answers_with_logprobs(api, post):
    answer = api.chat.completions.create(
        model=None, messages=HI, max_completion_tokens=8, logprobs=True, top_logprobs=3, **GREEDY
    )
    rendered = post("/tokenize", {"messages": HI, "add_generation_prompt": True}).json()["tokens"]
    assert answer.model_extra["prompt_token_ids"] == rendered
    assert answer.model_extra["weight_versions"] == [0]
    (choice,) = answer.choices
    tokens = choice.model_extra["token_ids"]
    assert len(tokens) == 8 and choice.message.role == "assistant"
    assert choice.model_extra["token_versions"] == [0] * 8
    content = choice.logprobs.content
    assert len(content) == 8 and all(len(c.top_logprobs) == 3 for c in content)
    assert answer.usage.prompt_tokens == len(rendered) and answer.usage.completion_tokens == 8
    plain = api.completions.create(model=None, prompt=rendered, max_tokens=8, **GREEDY)
    assert plain.choices[0].token_ids == tokens
    # Tools reach the template and the hermes parser: the random model calls
    # none, so its text is the content, as vLLM's parser leaves it.
    auto = api.chat.completions.create(model=None, messages=HI, tools=TOOLS, max_tokens=6)
    assert not auto.choices[0].message.tool_calls and auto.choices[0].message.content is not None


def test_a_stream_names_its_version_in_the_header(api):
    raw = api.chat.completions.with_raw_response.create(
        model=None, messages=HI, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["x-weight-versions"] == "0"
    chunks = list(raw.parse())
    assert chunks[-1].usage.completion_tokens == 6


def test_a_sync_during_a_running_http_request_freezes_and_resumes_it(
    ray_gpu, engines, api, hf_reference, tmp_path
):
    from engines.weight_sync.transports import checkpoint

    ray = ray_gpu
    engine = engines[0]
    served = ray.get(engine.health.remote(), timeout=TIMEOUT_S)["weight_version"]
    weights = hf_reference.state_dict()
    original = checkpoint.save(weights.items(), tmp_path / "original")
    scaled = {
        name: tensor * 1.5 if "lm_head" in name or "embed" in name else tensor
        for name, tensor in weights.items()
    }
    path = checkpoint.save(scaled.items(), tmp_path / "scaled")
    ask = {"model": None, "prompt": [[7, 8, 9]], "max_tokens": 1536, **GREEDY}
    old = api.completions.create(**ask).choices[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(api.completions.with_raw_response.create, **ask)
        wait_until(
            lambda: ray.get(engine.get_num_unfinished_requests.remote(), timeout=TIMEOUT_S),
            TIMEOUT_S,
            "the HTTP request to run",
        )
        ray.get(engine.pause_generation.remote(mode="keep"), timeout=TIMEOUT_S)
        assert not running.done()
        ray.get(engine.load_checkpoint.remote(str(path), version=served + 1), timeout=TIMEOUT_S)
        assert not running.done(), "the sync's own resume let the request go"
        ray.get(engine.resume_generation.remote(), timeout=TIMEOUT_S)
        raw = running.result(timeout=TIMEOUT_S)
    body = raw.http_response.json()
    both = [served, served + 1]
    assert raw.headers["x-weight-versions"] == f"{served},{served + 1}"
    assert body["weight_versions"] == both
    choice = body["choices"][0]
    tokens, versions = choice["token_ids"], choice["token_versions"]
    assert len(tokens) == 1536 and choice["finish_reason"] == "length"
    k = versions.index(served + 1)
    print(f"\nthe sync landed after token {k} of 1536")
    assert 0 < k < len(tokens) and versions == [served] * k + [served + 1] * (len(tokens) - k)
    assert tokens[:k] == old.token_ids[:k]  # sampled by the old weights
    after = api.completions.create(
        model=None, prompt=[[7, 8, 9, *tokens[:k]]], max_tokens=4, **GREEDY
    )
    assert after.choices[0].token_ids == tokens[k : k + 4]  # and then by the new ones
    ray.get(engine.load_checkpoint.remote(str(original), version=served + 2), timeout=TIMEOUT_S)


UNKNOWN_TOOL = {"type": "function", "function": {"name": "rm_rf"}}
BAD = [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "`nope` does not exist"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": "x"}, 400, "messages"),
    ("/v1/completions", {"prompt": [5] * (MAX_LEN + 10)}, 400, str(MAX_LEN)),
    (
        "/v1/chat/completions",
        {"messages": HI, "tools": TOOLS, "tool_choice": UNKNOWN_TOOL},
        400,
        "tool_choice",
    ),
    ("/v1/completions", {"prompt": [5, 999]}, 400, "999"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
]


@pytest.mark.parametrize(("path", "body", "status", "said"), BAD)
def test_bad_requests_get_vllms_errors_and_the_engine_keeps_serving(
    api, post, path, body, status, said
):
    answer = post(path, body)
    error = answer.json()["error"]
    print(f"\n{path} {body!s:.60}: {answer.status_code} {error['message']!s:.160}")
    assert answer.status_code == error["code"] == status
    assert said in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert api.completions.create(model=None, prompt="hi", max_tokens=2).choices
