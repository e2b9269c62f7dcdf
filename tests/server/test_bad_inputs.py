"""The bad-input suite: every endpoint, autoregressive and speculative (DFLASH_TFM with the committed bundle).

Each case is sent to a real `launch_server` process and must get its 4xx with an OpenAI-style JSON error that
names the problem (and the field, where there is one), after which `/health` must answer at once.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest

from dflash_tfm.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.server import MAX_MODEL_LEN, SPECULATIVE, ServerProcess, launch_server_process, shared_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
MSGS = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}
SMOLLM2_MAX_CHARS_PER_TOKEN = 81  # its longest vocabulary entry: prompts beyond 81 x context are refused unread
OVER_CHARS = "x" * (SMOLLM2_MAX_CHARS_PER_TOKEN * MAX_MODEL_LEN + 1)
SLOW_HEADERS = 3.0  # --timeout-read of the speculative test server
MODES = {"ar": (), "spec": (*SPECULATIVE, "--timeout-read", str(SLOW_HEADERS))}


def case(name, method, path, body, status, text, param=None, headers=None):
    """body: a dict (sent as JSON), bytes (sent as they are, with a JSON content type unless `headers` says
    otherwise) or None (no body)."""
    return pytest.param(method, path, body, status, text, param, headers or {}, id=name)


CASES = [
    # ---- malformed or mistyped JSON --------------------------------------------------------------------
    case("malformed-json", "POST", CHAT, b'{"messages": [', 400, "malformed JSON"),
    case("empty-body", "POST", COMPLETIONS, b"", 400, "body is empty"),
    case("not-an-object", "POST", COMPLETIONS, b"[1, 2]", 400, "JSON object"),
    case("deeply-nested", "POST", COMPLETIONS, b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400,
         "malformed JSON"),
    case("missing-messages", "POST", CHAT, {"max_tokens": 4}, 400, "field required", "messages"),
    case("missing-prompt", "POST", COMPLETIONS, {"max_tokens": 4}, 400, "field required", "prompt"),
    case("messages-not-list", "POST", CHAT, {"messages": "hi"}, 400, "messages", "messages"),
    case("prompt-wrong-type", "POST", COMPLETIONS, {"prompt": 5}, 400, "wrong type", "prompt"),
    case("prompt-null", "POST", COMPLETIONS, {"prompt": None}, 400, "wrong type", "prompt"),
    case("max-tokens-string", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": "4"}, 400, "valid integer",
         "max_tokens"),
    case("max-tokens-float", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 4.0}, 400, "valid integer",
         "max_tokens"),
    case("max-tokens-bool", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": True}, 400, "valid integer",
         "max_tokens"),
    case("temperature-string", "POST", CHAT, {"messages": MSGS, "temperature": "hot"}, 400, "valid number",
         "temperature"),
    case("stream-not-bool", "POST", CHAT, {"messages": MSGS, "stream": "yes"}, 400, "valid boolean", "stream"),
    case("seed-string", "POST", GENERATE, {"text": "x", "sampling_params": {"sampling_seed": "1"}}, 400,
         "valid integer", "sampling_params.sampling_seed"),
    case("seed-too-big", "POST", COMPLETIONS, {"prompt": "x", "seed": 2**65}, 400, "seed", "seed"),
    case("sampling-params-not-object", "POST", GENERATE, {"text": "x", "sampling_params": 5}, 400,
         "sampling_params", "sampling_params"),
    case("rid-not-string", "POST", GENERATE, {"text": "x", "rid": 5}, 400, "valid string", "rid"),
    case("ids-as-strings", "POST", GENERATE, {"input_ids": ["1", "2"]}, 400, "input_ids.0", "input_ids.0"),
    case("ids-as-bools", "POST", COMPLETIONS, {"prompt": [True, False]}, 400, "wrong type", "prompt"),
    case("top-k-float", "POST", GENERATE, {"text": "x", "sampling_params": {"top_k": 2.5}}, 400, "valid integer",
         "sampling_params.top_k"),
    case("stream-options-unknown", "POST", CHAT, {"messages": MSGS, "stream_options": {"x": 1}}, 400,
         "unknown field", "stream_options.x"),
    # ---- values out of range ---------------------------------------------------------------------------
    case("negative-max-tokens", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": -3}, 400, ">= 1", "max_tokens"),
    case("zero-max-tokens", "POST", CHAT, {"messages": MSGS, "max_tokens": 0}, 400, ">= 1", "max_tokens"),
    case("zero-max-completion-tokens", "POST", CHAT, {"messages": MSGS, "max_completion_tokens": 0}, 400, ">= 1",
         "max_completion_tokens"),
    case("huge-max-tokens", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 10**9}, 400,
         f"context is {MAX_MODEL_LEN} tokens", "max_tokens"),
    case("huge-max-new-tokens", "POST", GENERATE, {"text": "x", "sampling_params": {"max_new_tokens": 5000}}, 400,
         "5001", "sampling_params.max_new_tokens"),
    case("negative-temperature", "POST", CHAT, {"messages": MSGS, "temperature": -0.5}, 400,
         "temperature must be a number in [0, 100]", "temperature"),
    case("huge-temperature", "POST", CHAT, {"messages": MSGS, "temperature": 1e9}, 400, "[0, 100]", "temperature"),
    case("huge-temperature-native", "POST", GENERATE, {"text": "x", "sampling_params": {"temperature": 1e9}}, 400,
         "[0, 100]", "temperature"),
    case("nan-temperature", "POST", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, "temperature",
         "temperature"),
    case("infinite-top-p", "POST", GENERATE, b'{"text": "x", "sampling_params": {"top_p": Infinity}}', 400, "top_p",
         "top_p"),
    case("top-p-zero", "POST", COMPLETIONS, {"prompt": "x", "top_p": 0.0}, 400, "top_p must be in (0, 1]", "top_p"),
    case("top-p-above-one", "POST", GENERATE, {"text": "x", "sampling_params": {"top_p": 1.5}}, 400, "top_p", "top_p"),
    case("top-k-minus-two", "POST", COMPLETIONS, {"prompt": "x", "top_k": -2}, 400, "top_k", "top_k"),
    case("stop-too-many", "POST", CHAT, {"messages": MSGS, "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, 400,
         f"at most {MAX_STOP_STRINGS} stop strings", "stop"),
    case("stop-too-long", "POST", COMPLETIONS, {"prompt": "x", "stop": "s" * (MAX_STOP_CHARS + 1)}, 400,
         f"at most {MAX_STOP_CHARS} characters", "stop"),
    case("stop-160kB", "POST", GENERATE, {"text": "x", "sampling_params": {"stop": "ab" * 80_000}}, 400,
         f"at most {MAX_STOP_CHARS} characters", "stop"),
    case("stop-empty-string", "POST", COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, "non-empty strings", "stop"),
    case("stop-id-negative", "POST", GENERATE, {"text": "x", "sampling_params": {"stop_token_ids": [-1]}}, 400,
         "stop_token_ids", "stop_token_ids"),
    # ---- prompts that cannot be served -----------------------------------------------------------------
    case("prompt-over-context", "POST", COMPLETIONS, {"prompt": "hello " * 1500}, 400, f"context is {MAX_MODEL_LEN}",
         "prompt"),
    case("prompt-over-context-by-length", "POST", COMPLETIONS, {"prompt": OVER_CHARS}, 400, "characters", "prompt"),
    case("text-over-context-by-length", "POST", GENERATE, {"text": OVER_CHARS}, 400, "characters", "text"),
    case("chat-over-context-by-length", "POST", CHAT, {"messages": [{"role": "user", "content": OVER_CHARS}]}, 400,
         "characters", "messages"),
    case("ids-over-context", "POST", GENERATE, {"input_ids": [5] * (MAX_MODEL_LEN + 10)}, 400,
         f"context is {MAX_MODEL_LEN}", "input_ids"),
    case("ids-out-of-vocab", "POST", COMPLETIONS, {"prompt": [1, 2, 10**6]}, 400, "out of range", "prompt"),
    case("huge-id", "POST", GENERATE, {"input_ids": [2**63 - 1]}, 400, "out of range", "input_ids"),
    case("negative-id", "POST", GENERATE, {"input_ids": [-1, 5]}, 400, "out of range", "input_ids"),
    case("empty-prompt", "POST", COMPLETIONS, {"prompt": ""}, 400, "prompt is empty", "prompt"),
    case("empty-ids", "POST", GENERATE, {"input_ids": []}, 400, "prompt is empty", "input_ids"),
    case("empty-messages", "POST", CHAT, {"messages": []}, 400, "messages must not be empty", "messages"),
    case("lone-surrogate", "POST", COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400, "malformed JSON"),
    case("lone-surrogate-chat", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
         "malformed JSON"),
    case("batch-prompts", "POST", COMPLETIONS, {"prompt": ["a", "b"]}, 400, "one prompt per request", "prompt"),
    case("batch-id-prompts", "POST", COMPLETIONS, {"prompt": [[1, 2], [3]]}, 400, "one prompt per request", "prompt"),
    case("text-and-ids", "POST", GENERATE, {"text": "x", "input_ids": [1]}, 400, "exactly one of text or input_ids",
         "text"),
    case("neither-text-nor-ids", "POST", GENERATE, {"sampling_params": {}}, 400, "exactly one of text or input_ids",
         "text"),
    case("bad-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role",
         "messages.0.role"),
    case("message-unknown-key", "POST", CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
         400, "unknown field", "messages.0.tool_calls"),
    case("image-part", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "only text parts", "messages.0.content"),
    case("text-part-without-text", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         400, "only text parts", "messages.0.content"),
    case("template-kwargs", "POST", CHAT, {"messages": MSGS, "chat_template_kwargs": {"tools": []}}, 400,
         "supports only enable_thinking", "chat_template_kwargs"),
    # ---- features this server does not implement (refused, never silently ignored) ------------------
    case("n-two", "POST", CHAT, {"messages": MSGS, "n": 2}, 400, "n must be 1", "n"),
    case("presence-penalty", "POST", CHAT, {"messages": MSGS, "presence_penalty": 1.0}, 400, "presence_penalty",
         "presence_penalty"),
    case("frequency-penalty", "POST", COMPLETIONS, {"prompt": "x", "frequency_penalty": 0.5}, 400,
         "frequency_penalty", "frequency_penalty"),
    case("logit-bias", "POST", CHAT, {"messages": MSGS, "logit_bias": {"1": 5.0}}, 400, "logit_bias", "logit_bias"),
    case("logprobs", "POST", COMPLETIONS, {"prompt": "x", "logprobs": 2}, 400, "logprobs", "logprobs"),
    case("top-logprobs", "POST", CHAT, {"messages": MSGS, "top_logprobs": 5}, 400, "top_logprobs", "top_logprobs"),
    case("tools", "POST", CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
         "not supported by this server: tools", "tools"),
    case("tool-choice", "POST", CHAT, {"messages": MSGS, "tool_choice": "required"}, 400, "tool_choice",
         "tool_choice"),
    case("response-format", "POST", CHAT, {"messages": MSGS, "response_format": {"type": "json_object"}}, 400,
         "not supported by this server: response_format", "response_format"),
    case("unknown-field", "POST", COMPLETIONS, {"prompt": "x", "guided_json": {}}, 400,
         "not supported by this server: guided_json", "guided_json"),
    case("echo", "POST", COMPLETIONS, {"prompt": "x", "echo": True}, 400, "echo", "echo"),
    case("best-of", "POST", COMPLETIONS, {"prompt": "x", "best_of": 2}, 400, "best_of", "best_of"),
    case("suffix", "POST", COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix", "suffix"),
    case("return-logprob", "POST", GENERATE, {"text": "x", "return_logprob": True}, 400, "return_logprob",
         "return_logprob"),
    case("unknown-sampling-key", "POST", GENERATE, {"text": "x", "sampling_params": {"temprature": 0}}, 400,
         "unknown field", "sampling_params.temprature"),
    case("unknown-model-chat", "POST", CHAT, {"model": "gpt-4o", "messages": MSGS}, 404, "does not exist", "model"),
    case("unknown-model-completions", "POST", COMPLETIONS, {"model": "/etc/passwd", "prompt": "x"}, 404,
         "does not exist", "model"),
    # ---- transport: content type, size, host, method, path ----------------------------------------------
    case("text-plain-body", "POST", CHAT, json.dumps({"messages": MSGS}).encode(), 415, "application/json",
         "content-type", {"content-type": "text/plain"}),
    case("form-body", "POST", COMPLETIONS, b"prompt=x", 415, "application/json", "content-type",
         {"content-type": "application/x-www-form-urlencoded"}),
    case("no-content-type", "POST", GENERATE, b'{"text": "x"}', 415, "application/json", "content-type",
         {"content-type": ""}),
    case("body-over-limit", "POST", GENERATE, b'{"text": "' + b"x" * (9 << 20) + b'"}', 413, "over the limit"),
    case("foreign-host-chat", "POST", CHAT, {"messages": MSGS}, 400, "Host header", "host", {"host": "evil.example"}),
    case("foreign-host-metrics", "GET", "/metrics", None, 400, "Host header", "host",
         {"host": "rebind.attacker.example:30000"}),
    case("foreign-host-models", "GET", "/v1/models", None, 400, "Host header", "host", {"host": "192.168.1.2"}),
    case("unknown-path", "POST", "/v1/embeddings", {"input": "x"}, 404, "Not Found"),
    case("unknown-get-path", "GET", "/v1/files", None, 404, "Not Found"),
    case("get-generate", "GET", GENERATE, None, 405, "Method Not Allowed"),
    case("get-chat", "GET", CHAT, None, 405, "Method Not Allowed"),
    case("get-completions", "GET", COMPLETIONS, None, 405, "Method Not Allowed"),
    case("post-models", "POST", "/v1/models", {}, 405, "Method Not Allowed"),
    case("post-health", "POST", "/health", {}, 405, "Method Not Allowed"),
    case("post-health-generate", "POST", "/health_generate", {}, 405, "Method Not Allowed"),
    case("post-model-info", "POST", "/get_model_info", {}, 405, "Method Not Allowed"),
    case("post-metrics", "POST", "/metrics", {}, 405, "Method Not Allowed"),
    case("delete-flush-cache", "DELETE", "/flush_cache", None, 405, "Method Not Allowed"),
]


@pytest.fixture(scope="module", params=sorted(MODES))
def server(request) -> ServerProcess:
    for flags in MODES.values():  # both load at once
        launch_server_process(*flags)
    return shared_server(*MODES[request.param])


def send(server: ServerProcess, method: str, path: str, body: object, headers: dict[str, str]) -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
        headers = {**JSON, **headers}
    elif isinstance(body, bytes):
        headers = {**JSON, **headers}
    headers = {k: v for k, v in headers.items() if v}
    return httpx.request(method, server.base_url + path, content=body, headers=headers, timeout=60.0)


@pytest.mark.parametrize("method,path,body,status,text,param,headers", CASES)
def test_bad_input_gets_its_4xx_and_health_answers(server: ServerProcess, method: str, path: str, body: object,
                                                   status: int, text: str, param: str | None,
                                                   headers: dict[str, str]) -> None:
    r = send(server, method, path, body, headers)
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert text in error["message"], error
    assert error["param"] == param and error["type"]
    assert error["code"] in (status, "model_not_found")
    assert r.headers["x-request-id"]
    start = time.perf_counter()
    assert httpx.get(f"{server.base_url}/health", timeout=5.0).status_code == 200
    assert time.perf_counter() - start < 1.0


def test_suite_covers_every_endpoint_and_enough_cases() -> None:
    paths = {p.values[1] for p in CASES}
    for endpoint in (CHAT, COMPLETIONS, GENERATE, "/v1/models", "/health", "/health_generate", "/flush_cache",
                     "/get_model_info", "/metrics"):
        assert endpoint in paths, endpoint
    assert len(CASES) * len(MODES) >= 120
