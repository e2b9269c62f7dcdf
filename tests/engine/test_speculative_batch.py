"""Batched speculative decoding: every request in a running batch gets exactly what it gets decoded alone.

Oracle: `Engine.generate` of each request alone (the batch-1 `SpeculativeDecoder`, itself greedy-equal to plain
decoding: tests/spec). Tiny random targets (dense llama, the Gated-DeltaNet hybrid and its mixture-of-experts
variant) with random drafters and Weavers, every algorithm at a fixed budget; the same request mixes as the
autoregressive batch's tests (mixed prompt lengths, budgets, stop conditions, one cut by the context, one aborted
mid-run, sampled requests with their own seeds), so rows sit at different lengths and accept different counts.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from dflash_tfm import Engine, SamplingParams, SpeculativeConfig
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.budget import BudgetController
from dflash_tfm.engine.speculative_batch import SpeculativeBatch
from dflash_tfm.loading.loader import open_checkpoint
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from tests.engine.test_continuous_batching import (MAX_LEN, SLOTS,  # noqa: F401 (one_thread: a fixture)
                                                   assert_sampled_requests_reproduce_their_solo_draws, mixed_requests,
                                                   one_thread, run_batch, solo)
from tests.train.tiny_chat import save_tiny_chat_model

BLOCK = 8
SETTINGS = [("llama", "DFLASH"), ("qwen3_5_text", "DDTREE"), ("qwen3_5_moe_text", "DFLASH_TFM"), ("llama", "DFLASH_TFM")]


def tiny_speculative_setup(root: Path, arch: str, algorithm: str,
                           tree_budget: int | str = 12) -> tuple[Path, SpeculativeConfig]:
    """A tiny random `arch` chat model under ``root`` and a random drafter (and Weaver) for `algorithm`."""
    path = save_tiny_chat_model(root, arch)
    cfg = ModelConfig.from_dict(open_checkpoint(path)[1])
    drafter = write_random_dflash_checkpoint(root / "dflash", cfg, num_layers=1, block_size=BLOCK,
                                             target_layer_ids=[0, cfg.num_layers - 1])
    weaver = None
    if algorithm == "DFLASH_TFM":
        weaver = root / "weaver.pth"
        write_random_weaver_checkpoint(weaver, cfg, K=BLOCK - 1, variant=1)
    return path, SpeculativeConfig(algorithm, drafter, weaver, tree_budget=tree_budget)


@pytest.fixture(scope="module", params=SETTINGS, ids=["-".join(s) for s in SETTINGS])
def engine(request, tmp_path_factory) -> Engine:
    path, spec = tiny_speculative_setup(tmp_path_factory.mktemp("spec_batch"), *request.param)
    return Engine(path, spec, device="cpu", dtype="float32", max_model_len=MAX_LEN, max_running_requests=SLOTS,
                  progress=False)


def test_the_engine_batches_speculative_decoding(engine: Engine) -> None:
    assert isinstance(engine.batch, SpeculativeBatch) and engine.free_slots == SLOTS


def test_greedy_requests_in_a_batch_equal_their_solo_outputs(engine: Engine) -> None:
    requests = mixed_requests(engine)
    expected = {i: solo(engine, *r) for i, r in enumerate(requests)}
    got = run_batch(engine, requests, abort=2, abort_after=4)
    aborted = got.pop(2)
    assert aborted[0] == expected.pop(2)[0][: len(aborted[0])] and len(aborted[0]) >= 4 and aborted[2] is None
    assert got == expected
    assert len(expected[6][0]) == MAX_LEN - 50  # the context end cut one request: its trees reached past it
    assert engine.free_slots == SLOTS


def test_requests_all_arriving_at_once_equal_their_solo_outputs(engine: Engine) -> None:
    requests = mixed_requests(engine)
    assert run_batch(engine, requests, arrive_every=0) == {i: solo(engine, *r) for i, r in enumerate(requests)}


def test_sampled_requests_reproduce_their_solo_draws(engine: Engine) -> None:
    assert_sampled_requests_reproduce_their_solo_draws(engine)


def test_a_step_verifies_every_row_in_one_forward_and_accepts_per_row(engine: Engine, monkeypatch) -> None:
    """One verify per step over the bucket's rows; the rows' stats count their own steps and drafts."""
    trees: list[int] = []
    verify = type(engine.batch.model).verify

    def recording(self, tree, *args, **kw):
        trees.append(tree.tokens.shape[0])
        return verify(self, tree, *args, **kw)

    monkeypatch.setattr(type(engine.batch.model), "verify", recording)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    seqs = [engine.add_request([5 + i, 6, 7], params) for i in range(SLOTS)]
    engine.step()  # prefills the first request, then its first tree
    assert trees == [1]
    while engine.batch.running:
        engine.step()
    assert max(trees) == SLOTS
    for seq in seqs:
        stats = seq.stats
        assert stats.completion_tokens == 10 and stats.verify_steps >= 2
        assert stats.draft_tokens == (stats.verify_steps - 1) * (max(engine.batch.proposers) + 1) - (stats.verify_steps - 1)


@pytest.fixture(scope="module")
def adaptive(tmp_path_factory) -> Engine:
    """A hybrid target with DDTREE at budget 'auto': one adaptive budget per batch bucket."""
    path, spec = tiny_speculative_setup(tmp_path_factory.mktemp("spec_batch_auto"), "qwen3_5_text", "DDTREE", "auto")
    return Engine(path, spec, device="cpu", dtype="float32", max_model_len=MAX_LEN, max_running_requests=SLOTS,
                  progress=False)


def test_auto_budget_measures_every_bucket_and_size(adaptive: Engine) -> None:
    batch = adaptive.batch
    assert batch.sizes[0] == 0 and len(batch.sizes) > 2
    assert sorted(batch.budgets) == [1, 2, 3]  # the batch buckets of 3 slots
    for budget in batch.budgets.values():
        assert set(budget.step_seconds) == set(batch.sizes) and all(t > 0 for t in budget.step_seconds.values())
    assert not batch.running and batch._length.eq(0).all()  # the measuring steps left nothing behind


def test_auto_budget_batches_equal_their_solo_outputs_whatever_sizes_they_take(adaptive: Engine) -> None:
    """Greedy requests through a batch whose budgets change sizes step by step: the solo outputs, and every size's
    steps counted in the requests' stats."""
    batch = adaptive.batch
    requests = mixed_requests(adaptive)
    expected = {i: solo(adaptive, *r) for i, r in enumerate(requests)}
    for budget in batch.budgets.values():
        budget.forget()
    assert run_batch(adaptive, requests) == expected
    taken = sum((b.chosen for b in batch.budgets.values()), Counter())
    assert sum(taken.values()) > 0 and len(taken) >= 2, taken


def test_a_new_request_resets_every_buckets_probe_interval(adaptive: Engine) -> None:
    """As for one request (`BudgetController.start_request`): a bucket that stopped speculating probes again at
    the shortest interval once a new request joins."""
    budget = adaptive.batch.budgets[2]
    budget._probe_interval = 8 * budget.probe_every
    seq = adaptive.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=2))
    assert budget._probe_interval == budget.probe_every
    adaptive.batch.abort(seq)


def test_a_dear_batched_verify_shrinks_the_trees_to_plain_decoding(adaptive: Engine) -> None:
    """Step times where verifying trees for three rows costs 5x a plain batched step: the bucket-3 steps decode
    plainly once speculation is shown not to pay there, bucket 1 keeps its trees; outputs stay the solo ones."""
    batch = adaptive.batch
    cheap = {0: 1.0, **{b: 1.1 for b in batch.sizes[1:]}}
    dear = {0: 1.0, **{b: 5.0 + b / 8 for b in batch.sizes[1:]}}
    batch.budgets = {1: BudgetController(batch.sizes, cheap), 2: BudgetController(batch.sizes, cheap),
                     3: BudgetController(batch.sizes, dear)}
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    prompts = [[5 + i, 9, 11, 13] for i in range(3)]
    expected = [solo(adaptive, p, params) for p in prompts]
    seqs = [adaptive.add_request(p, params) for p in prompts]
    got = {id(s): [] for s in seqs}
    while adaptive.batch.running:
        for seq, delta in adaptive.step():
            got[id(seq)] += delta.token_ids
    assert [got[id(s)] for s in seqs] == [e[0] for e in expected]
    chosen = batch.budgets[3].chosen
    assert chosen[0] > sum(n for b, n in chosen.items() if b) and chosen[0] >= 5, chosen
    assert not batch.budgets[3].speculating


def test_prompts_are_fed_a_chunk_per_step_while_the_others_decode(engine: Engine) -> None:
    """With 4-token prompt chunks a 30-token prompt takes 8 steps, in each of which the running request produces
    tokens (the newcomer's row, inside the step's bucket, accepts nothing meanwhile); every output is the solo
    one, for the mixed requests too."""
    original = engine.batch
    (proposer,) = original.proposers.values()
    engine.batch = SpeculativeBatch(original.runner, original.drafter, proposer, MAX_LEN, prefill_chunk=4)
    try:
        requests = mixed_requests(engine)
        assert run_batch(engine, requests) == {i: solo(engine, *r) for i, r in enumerate(requests)}
        first = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
        second = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        long_prompt = list(range(20, 50))
        a = engine.add_request([5, 6, 7], first)
        tokens = {id(a): [t for _, delta in engine.step() for t in delta.token_ids]}  # a's prompt and first tree
        b = engine.add_request(long_prompt, second)
        tokens[id(b)] = []
        a_steps_before_b = 0  # steps that produced tokens for a while b's prompt was still going in
        while engine.batch.running:
            deltas = engine.step()
            for seq, delta in deltas:
                tokens[id(seq)] += delta.token_ids
            if not tokens[id(b)] and any(seq is a and delta.token_ids for seq, delta in deltas):
                a_steps_before_b += 1
        assert a_steps_before_b == 7  # b's first 7 chunks; its 8th step also draws its first token
        assert tokens[id(a)] == solo(engine, [5, 6, 7], first)[0]
        assert tokens[id(b)] == solo(engine, long_prompt, second)[0]
    finally:
        engine.batch = original


def test_a_batch_without_room_for_a_tree_is_refused(engine: Engine) -> None:
    batch = engine.batch
    with pytest.raises(ValueError, match="max_len \\+ a tree"):
        SpeculativeBatch(batch.runner, batch.drafter, batch.proposers, max_len=batch.runner.max_len)
    with pytest.raises(ValueError, match="prefill_chunk"):
        SpeculativeBatch(batch.runner, batch.drafter, batch.proposers, max_len=MAX_LEN, prefill_chunk=0)
