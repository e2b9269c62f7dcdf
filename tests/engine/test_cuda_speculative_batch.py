"""GPU-only: the batched speculative step as CUDA-graph replays (draft, tree, verify and commit graphs per batch
bucket) gives every request the tokens the same batch gives eagerly, and its solo output; greedy and sampled
requests (a sampled row's settings are constants of its commit graph), on tiny random llama, hybrid and MoE
targets with every algorithm; and with the adaptive budget, whose sizes change between graphed steps."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_tfm import Engine
from dflash_tfm.engine.speculative_batch import SpeculativeBatch
from tests.engine.test_continuous_batching import (MAX_LEN, SLOTS, assert_sampled_requests_reproduce_their_solo_draws,
                                                   mixed_requests, run_batch, solo)
from tests.engine.test_speculative_batch import tiny_speculative_setup

pytestmark = pytest.mark.gpu

SETTINGS = [("llama", "DFLASH"), ("qwen3_5_text", "DDTREE"), ("qwen3_5_moe_text", "DFLASH_TFM")]


@pytest.fixture(scope="module", params=SETTINGS, ids=["-".join(s) for s in SETTINGS])
def checkpoints(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return tiny_speculative_setup(tmp_path_factory.mktemp("cuda_spec_batch"), *request.param)


def engine(checkpoints, graphs: bool) -> Engine:
    path, spec = checkpoints
    return Engine(path, spec, device="cuda", dtype="float32", max_model_len=MAX_LEN, max_running_requests=SLOTS,
                  use_cuda_graph=graphs, progress=False)


def test_graph_steps_equal_eager_steps_and_solo_outputs(checkpoints) -> None:
    graphed, eager = engine(checkpoints, True), engine(checkpoints, False)
    requests = mixed_requests(graphed)
    got = run_batch(graphed, requests)
    assert isinstance(graphed.batch, SpeculativeBatch)
    captured = {key[0] for key in graphed.batch.graphs._graphs}
    assert captured == {"draft", "tree", "verify", "commit"}, captured
    assert got == run_batch(eager, requests)  # the same kernels, replayed: identical tokens
    assert got == {i: solo(graphed, *r) for i, r in enumerate(requests)}


def test_sampled_requests_in_graphs_reproduce_their_solo_draws(checkpoints) -> None:
    assert_sampled_requests_reproduce_their_solo_draws(engine(checkpoints, True))


def test_auto_budget_graph_steps_equal_solo_outputs(checkpoints) -> None:
    path, spec = checkpoints
    auto = Engine(path, replace(spec, tree_budget="auto"), device="cuda", dtype="float32", max_model_len=MAX_LEN,
                  max_running_requests=SLOTS, progress=False)
    requests = mixed_requests(auto)
    assert run_batch(auto, requests) == {i: solo(auto, *r) for i, r in enumerate(requests)}
    sizes = {key[2] for key in auto.batch.graphs._graphs if key[0] == "verify"}
    assert len(sizes) >= 2, sizes  # the measuring steps alone captured every size of every bucket
