"""Continuous batching: every request in a running batch gets exactly what it gets decoded alone.

Oracle: `Engine.generate` of each request alone (the batch-1 `AutoregressiveDecoder`). Tiny random targets of each
family (dense llama and qwen3, the Gated-DeltaNet hybrid qwen3_5, its mixture-of-experts variant) with a word-level
tokenizer, and the embedded SmolLM2 against a separate batch-1 engine. Requests of mixed prompt lengths, token
budgets and stop conditions join while others decode (fewer slots than requests), one leaves mid-run (aborted),
and sampled requests draw their solo tokens from their own seeds.
"""
from __future__ import annotations

import pytest
import torch

from dflash_tfm import Engine, SamplingParams
from dflash_tfm.engine.batch_runner import batch_bucket
from dflash_tfm.engine.continuous_batching import ContinuousBatch
from tests.engine.test_batch_generation import ReplayedFirstCapture
from tests.train.tiny_chat import save_tiny_chat_model

MAX_LEN = 64
SLOTS = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny steps on shared cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_5_text", "qwen3_5_moe_text"])
def engine(request, tmp_path_factory) -> Engine:
    path = save_tiny_chat_model(tmp_path_factory.mktemp("tiny"), request.param)
    return Engine(path, device="cpu", dtype="float32", max_model_len=MAX_LEN, max_running_requests=SLOTS,
                  progress=False)


def run_batch(engine: Engine, requests: list[tuple[list[int], SamplingParams]], *, arrive_every: int = 2,
              abort: int | None = None, abort_after: int = 3) -> dict[int, tuple[list[int], str, str | None]]:
    """Drive `engine`'s batch: request i arrives at step i * arrive_every (or later, when a slot is free); request
    `abort` is aborted after `abort_after` of its tokens. -> {i: (token ids, text, finish reason)}."""
    out: dict[int, tuple[list[int], str, str | None]] = {}
    index: dict[int, int] = {}
    waiting = list(range(len(requests)))
    step = 0
    while waiting or engine.batch.running:
        while waiting and waiting[0] * arrive_every <= step and engine.free_slots:
            i = waiting.pop(0)
            seq = engine.add_request(*requests[i])
            index[id(seq)], out[i] = i, ([], "", None)
        for seq, delta in engine.step():
            i = index[id(seq)]
            ids, text, _ = out[i]
            out[i] = (ids + delta.token_ids, text + delta.text, delta.finish_reason)
            if i == abort and len(out[i][0]) == abort_after:
                engine.abort_request(seq)
        step += 1
    return out


def solo(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
    result = engine.generate(prompt, params)
    return result.token_ids, result.text, result.finish_reason


def mixed_requests(engine: Engine) -> list[tuple[list[int], SamplingParams]]:
    """Seven greedy requests: prompt lengths 3 … 50, budgets 1 … 40 (one cut by the context), EOS honoured or
    not, and one stop string taken from the middle of its own solo text."""
    gen = torch.Generator().manual_seed(0)
    lengths, budgets = [3, 17, 9, 30, 5, 12, 50], [12, 5, 20, 1, 9, 40, 30]
    prompts = [torch.randint(5, 160, (n,), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(temperature=0.0, max_new_tokens=b, ignore_eos=i % 2 == 0)
              for i, b in enumerate(budgets)]
    words = solo(engine, prompts[5], params[5])[1].split()
    assert len(words) > 8, "the stop-string request needs a long solo text"
    params[5] = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, stop=[" ".join(words[4:6])])
    return list(zip(prompts, params))


def test_greedy_requests_in_a_batch_equal_their_solo_outputs(engine: Engine) -> None:
    requests = mixed_requests(engine)
    expected = {i: solo(engine, *r) for i, r in enumerate(requests)}
    got = run_batch(engine, requests, abort=2, abort_after=4)
    aborted = got.pop(2)
    assert aborted[0] == expected.pop(2)[0][:4] and aborted[2] is None  # left mid-run, its tokens right so far
    assert got == expected
    assert expected[5][2] == "stop" and len(expected[5][0]) < 40  # the stop string ended one request
    assert len(expected[6][0]) == MAX_LEN - 50  # the context end cut another
    assert engine.free_slots == SLOTS


def test_requests_all_arriving_at_once_equal_their_solo_outputs(engine: Engine) -> None:
    requests = mixed_requests(engine)
    assert run_batch(engine, requests, arrive_every=0) == {i: solo(engine, *r) for i, r in enumerate(requests)}


def test_prompts_fed_in_chunks_between_decode_steps_equal_their_solo_outputs(engine: Engine, monkeypatch) -> None:
    """Long prompts enter 7 tokens per step while the others decode: a newcomer holds the batch up by one chunk
    per step, and its chunks continue its row's caches exactly as one prefill would."""
    monkeypatch.setattr(engine, "batch", ContinuousBatch(engine.batch.runner, prefill_chunk=7))
    requests = mixed_requests(engine)
    expected = {i: solo(engine, *r) for i, r in enumerate(requests)}
    assert run_batch(engine, requests, arrive_every=1) == expected
    with pytest.raises(ValueError, match="prefill_chunk"):
        ContinuousBatch(engine.batch.runner, prefill_chunk=0)


def test_sampled_requests_reproduce_their_solo_draws(engine: Engine) -> None:
    assert_sampled_requests_reproduce_their_solo_draws(engine)


def assert_sampled_requests_reproduce_their_solo_draws(engine: Engine) -> None:
    """Four requests with their own temperatures, top-p / top-k and seeds (one greedy) joining a step apart."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 160, (n,), generator=gen).tolist() for n in (4, 11, 7, 20)]
    requests = [(p, SamplingParams(temperature=t, top_p=p_, top_k=k, seed=s, max_new_tokens=12, ignore_eos=True))
                for p, (t, p_, k, s) in zip(prompts, [(1.0, 1.0, -1, 3), (0.8, 0.9, -1, 4), (1.3, 1.0, 20, 5),
                                                      (0.0, 1.0, -1, None)])]
    expected = {i: solo(engine, *r) for i, r in enumerate(requests)}
    assert run_batch(engine, requests, arrive_every=1) == expected
    other_seed = SamplingParams(temperature=1.0, seed=99, max_new_tokens=12, ignore_eos=True)
    assert solo(engine, prompts[0], other_seed)[0] != expected[0][0]  # the seed matters: the check can fail


def test_a_lone_request_steps_one_row_and_a_full_batch_every_row(engine: Engine, monkeypatch) -> None:
    rows: list[int] = []
    forward = type(engine.batch.runner.model).forward

    def recording(self, ids, positions, cache, kv_len, **kw):
        if ids.shape[1] == 1:
            rows.append(ids.shape[0])
        return forward(self, ids, positions, cache, kv_len=kv_len, **kw)

    monkeypatch.setattr(type(engine.batch.runner.model), "forward", recording)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    run_batch(engine, [([5, 6, 7], params)])
    assert rows == [1, 1, 1]
    rows.clear()
    run_batch(engine, [([5, 6, 7], params)] * SLOTS, arrive_every=0)
    assert max(rows) == batch_bucket(SLOTS, SLOTS) == SLOTS


def test_steps_replayed_from_static_buffers_equal_eager(engine: Engine, monkeypatch) -> None:
    """With CUDA graphs' semantics (a key's first step is what later steps of that key replay, reading only the
    static buffers), every request still gets its solo output: the step depends on nothing but its key."""
    graphs = ReplayedFirstCapture()
    monkeypatch.setattr(engine.batch.runner, "graphs", graphs)
    requests = mixed_requests(engine)
    assert run_batch(engine, requests, arrive_every=1) == {i: solo(engine, *r) for i, r in enumerate(requests)}
    assert {key[1] for key in graphs.captured} == {1, 2, 3}  # the steps ran at every batch bucket


def test_batch_bucket() -> None:
    assert [batch_bucket(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert batch_bucket(3, 3) == 3


def test_bad_use_is_refused_with_a_clear_error(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=3)
    seqs = [engine.add_request([5, 6], params) for _ in range(SLOTS)]
    with pytest.raises(RuntimeError, match="max_running_requests"):
        engine.add_request([5, 6], params)
    with pytest.raises(RuntimeError, match="add_request"):
        next(iter(engine.stream([5, 6], params)))
    with pytest.raises(ValueError, match="context"):
        engine.add_request([5] * MAX_LEN, params)
    for seq in seqs:
        engine.abort_request(seq)
    assert engine.free_slots == SLOTS and engine.step() == []
    stream = engine.stream([5, 6], params)
    next(stream)
    with pytest.raises(RuntimeError, match="stream is decoding"):
        engine.add_request([5, 6], params)
    stream.close()
    engine.abort_request(engine.add_request([5, 6], params))


def test_batch_runner_refuses_what_does_not_fit_its_rows(engine: Engine) -> None:
    runner = engine.batch.runner
    with pytest.raises(ValueError, match="do not fit"):
        runner.prefill(0, [])
    with pytest.raises(ValueError, match="do not fit"):
        runner.prefill(0, [5] * 10, start=MAX_LEN - 10)
    with pytest.raises(ValueError, match="beyond the cache rows"):
        runner.decode({0: 5}, {0: MAX_LEN})


def test_engine_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="max_running_requests must be >= 1"):
        Engine(device="cpu", dtype="float32", max_model_len=64, max_running_requests=0, progress=False)


def test_batch_one_engine_has_no_batch(smollm2: Engine) -> None:
    assert smollm2.free_slots == 0
    with pytest.raises(RuntimeError, match="max_running_requests > 1"):
        smollm2.add_request("Hi", SamplingParams(max_new_tokens=2))


def test_smollm2_batch_equals_the_batch_one_engine(smollm2: Engine) -> None:
    batched = Engine(device="cpu", dtype="float32", max_model_len=512, max_running_requests=4, progress=False)
    texts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
             "Explain why the sky is blue in one sentence.", "def fibonacci(n):", "Hello"]
    requests = [(batched.encode_prompt(t, chat=i % 2 == 1), SamplingParams(temperature=0.0, max_new_tokens=m))
                for i, (t, m) in enumerate(zip(texts, [16, 24, 8, 20, 12, 6]))]
    requests.append((requests[0][0], SamplingParams(temperature=0.7, seed=11, max_new_tokens=16)))
    requests.append((requests[1][0], SamplingParams(temperature=0.0, max_new_tokens=30, stop=["\n"])))
    expected = {i: solo(smollm2, *r) for i, r in enumerate(requests)}
    assert run_batch(batched, requests, arrive_every=3) == expected
