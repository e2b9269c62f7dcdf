"""Batched speculative decoding: every request in a running batch gets exactly what it gets decoded alone.

Oracle: `Engine.generate` of each request alone (the batch-1 `SpeculativeDecoder`, itself greedy-equal to plain
decoding: tests/spec). Tiny random targets (dense llama, the Gated-DeltaNet hybrid and its mixture-of-experts
variant) with random drafters and Weavers, every algorithm at a fixed budget; the same request mixes as the
autoregressive batch's tests (mixed prompt lengths, budgets, stop conditions, one cut by the context, one aborted
mid-run, sampled requests with their own seeds), so rows sit at different lengths and accept different counts.
"""
from __future__ import annotations

import pytest

from dflash_tfm import Engine, SamplingParams, SpeculativeConfig
from dflash_tfm.config import ModelConfig
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


@pytest.fixture(scope="module", params=SETTINGS, ids=["-".join(s) for s in SETTINGS])
def engine(request, tmp_path_factory) -> Engine:
    arch, algorithm = request.param
    root = tmp_path_factory.mktemp("spec_batch")
    path = save_tiny_chat_model(root, arch)
    cfg = ModelConfig.from_dict(open_checkpoint(path)[1])
    drafter = write_random_dflash_checkpoint(root / "dflash", cfg, num_layers=1, block_size=BLOCK,
                                             target_layer_ids=[0, cfg.num_layers - 1])
    weaver = None
    if algorithm == "DFLASH_TFM":
        weaver = root / "weaver.pth"
        write_random_weaver_checkpoint(weaver, cfg, K=BLOCK - 1, variant=1)
    spec = SpeculativeConfig(algorithm, drafter, weaver, tree_budget=12)
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
        assert stats.draft_tokens == (stats.verify_steps - 1) * engine.batch.proposer.num_nodes - (stats.verify_steps - 1)


def test_auto_budget_is_refused_for_batches() -> None:
    with pytest.raises(ValueError, match="fixed proposal size"):
        Engine(speculative=SpeculativeConfig("DDTREE"), device="cpu", dtype="float32", max_model_len=64,
               max_running_requests=4, progress=False)


def test_a_batch_without_room_for_a_tree_is_refused(engine: Engine) -> None:
    batch = engine.batch
    with pytest.raises(ValueError, match="max_len \\+ a tree"):
        SpeculativeBatch(batch.runner, batch.drafter, batch.proposer, max_len=batch.runner.max_len)
    with pytest.raises(ValueError, match="prefill_chunk"):
        SpeculativeBatch(batch.runner, batch.drafter, batch.proposer, max_len=MAX_LEN, prefill_chunk=0)
