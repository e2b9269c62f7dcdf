"""A real `python -m dflash_tfm.launch_server` process driven by the official openai client and raw httpx.

At temperature 0 every endpoint must return exactly what `Engine.generate` returns in this process.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from dflash_tfm import SamplingParams
from tests.server import (SERVED_NAME, ServerProcess, reference_engine, reference_server_fixture,  # noqa: F401
                          scrape, single_thread_fixture, wait_idle)  # (the fixtures: one torch thread, `server`)

CHAT = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def engine(server: ServerProcess):
    return reference_engine()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120.0)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def test_chat_completion_matches_engine(client: openai.OpenAI, engine) -> None:
    ref = engine.generate(CHAT, greedy(16))
    resp = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=16, temperature=0)
    choice = resp.choices[0]
    assert choice.message.content == ref.text and choice.message.role == "assistant"
    assert choice.finish_reason == ref.finish_reason
    assert resp.usage.prompt_tokens == len(engine.apply_chat_template(CHAT))
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")


def test_completion_matches_engine_with_stop(client: openai.OpenAI, engine) -> None:
    ref = engine.generate(PROMPT, greedy(16))
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"top_k": -1})
    assert resp.choices[0].text == ref.text
    assert resp.usage.prompt_tokens == len(engine.encode_prompt(PROMPT))
    assert resp.usage.completion_tokens == len(ref.token_ids)

    stop = ref.text.strip().split()[1]  # a word the greedy completion is known to contain
    ref_stop = engine.generate(PROMPT, greedy(16, stop=[stop]))
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop)
    assert resp.choices[0].text == ref_stop.text and resp.choices[0].finish_reason == "stop"
    assert stop not in resp.choices[0].text


def test_completion_from_token_ids(client: openai.OpenAI, engine) -> None:
    ids = engine.encode_prompt(PROMPT)
    resp = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert resp.choices[0].text == engine.generate(ids, greedy(8)).text


def test_seeded_sampling_matches_engine(client: openai.OpenAI, engine) -> None:
    ref = engine.generate(PROMPT, SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=8, seed=1234))
    texts = [client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.95,
                                       seed=1234).choices[0].text for _ in range(2)]
    assert texts == [ref.text, ref.text]


def test_streaming_chat_and_completion(client: openai.OpenAI, engine) -> None:
    ref = engine.generate(CHAT, greedy(16))
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert len({c.id for c in chunks}) == 1

    ref = engine.generate(PROMPT, greedy(16))
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason and chunks[-1].usage is None


def test_sse_wire_format_ends_with_done(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60.0) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1


def test_generate_text_and_input_ids_meta_info(server: ServerProcess, engine) -> None:
    ref = engine.generate(PROMPT, greedy(12))
    ids = engine.encode_prompt(PROMPT)
    for payload in ({"text": PROMPT}, {"input_ids": ids}):
        payload["sampling_params"] = {"temperature": 0, "max_new_tokens": 12, "sampling_seed": 7}
        body = httpx.post(f"{server.base_url}/generate", json=payload, timeout=60.0).raise_for_status().json()
        meta = body["meta_info"]
        assert body["text"] == ref.text and body["output_ids"] == ref.token_ids
        assert meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == len(body["output_ids"]) == len(ref.token_ids)
        assert meta["spec_verify_ct"] == meta["completion_tokens"]  # autoregressive: tau = 1
        assert meta["finish_reason"]["type"] == ref.finish_reason
        assert meta["e2e_latency"] > 0


def test_generate_stream_is_cumulative(server: ServerProcess, engine) -> None:
    ref = engine.generate(PROMPT, greedy(8, ignore_eos=True))
    payload = {"text": PROMPT, "stream": True,
               "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    with httpx.stream("POST", f"{server.base_url}/generate", json=payload, timeout=60.0) as r:
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len(chunks) == 8 and [c["meta_info"]["completion_tokens"] for c in chunks] == list(range(1, 9))
    assert chunks[-1]["text"] == ref.text and chunks[-1]["output_ids"] == ref.token_ids
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_sixteen_concurrent_clients_each_get_their_own_output(client: openai.OpenAI, engine) -> None:
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(16)]

    def ask(prompt: str) -> str:
        return client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        answers = [pool.submit(ask, p) for p in prompts]
        refs = [engine.generate(p, greedy(6)).text for p in prompts]  # computed while the server works
        assert [a.result() for a in answers] == refs


def test_models_info_flush_and_health(client: openai.OpenAI, server: ServerProcess, engine) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == SERVED_NAME
    info = httpx.get(f"{server.base_url}/get_model_info").json()
    assert info["model_path"] == engine.model_path.name and info["is_generation"] is True  # no absolute path
    assert info["speculative_algorithm"] is None and info["max_model_len"] == engine.max_model_len
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{server.base_url}/flush_cache")
        assert r.status_code == 200 and "no prefix cache" in r.json()["message"]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/health_generate", timeout=60.0).status_code == 200


def test_metrics_count_requests_tokens_and_latency(server: ServerProcess, engine) -> None:
    before = wait_idle(server.base_url)
    payload = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}}
    httpx.post(f"{server.base_url}/generate", json=payload, timeout=60.0).raise_for_status()
    httpx.post(f"{server.base_url}/generate", json={"text": ""}, timeout=60.0)  # a 400
    after = scrape(server.base_url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("dflash_tfm_http_requests_total", endpoint="/generate", status="200") == 1
    assert delta("dflash_tfm_http_requests_total", endpoint="/generate", status="400") == 1
    assert delta("dflash_tfm_prompt_tokens_total") == len(engine.encode_prompt(PROMPT))
    assert delta("dflash_tfm_generation_tokens_total") == 5
    for hist in ("accept_length", "e2e_request_latency_seconds", "time_to_first_token_seconds", "prefill_seconds",
                 "decode_seconds"):
        assert delta(f"dflash_tfm_{hist}_count") == 1, hist
    assert delta("dflash_tfm_accept_length_sum") == pytest.approx(1.0)  # autoregressive tau
    assert after[("dflash_tfm_num_running_requests", ())] == 0
    assert after[("dflash_tfm_num_queued_requests", ())] == 0
