"""Tensor parallelism on CPU (gloo): a target split over 2 or 4 ranks gives the logits of the whole target, in
prefill, a decode step, a tree verify and the decode step after committing a path of that tree.

Oracle: the same passes at tp 1 (itself checked against transformers in tests/models/test_parity.py). Each
rank loads only its slice from the safetensors directory; dense (llama, qwen3), hybrid (qwen3.5 and the
head-grouped qwen3-next layout) and mixture-of-experts targets (per-expert and fused expert tensors).
"""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.layers.moe import SparseMoE
from dflash_tfm.loading.loader import load_model, open_checkpoint
from dflash_tfm.parallel.sharding import Shard
from dflash_tfm.tree import TreeSpec

from ..models.tiny_targets import fuse_experts, save_hf_model
from .ranks import run_ranks

PROMPT_LEN = 13
CPU = torch.device("cpu")


def passes(rank: int, tp: int, path: str, whole_experts: bool = False) -> dict[str, torch.Tensor]:
    """fp32 logits of one rank's slice (`whole_experts`: expert parallelism): prefill, one decode step, a 9-node
    tree verify, and the decode step after committing the path to the tree's last node."""
    source, raw, _ = open_checkpoint(path)
    model, _ = load_model(source, raw, CPU, torch.float32, 512, progress=False,
                          shard=Shard(rank, tp, experts=whole_experts))
    if model.config.moe_layers:
        held = {layer.mlp.experts_gate_up.shape[0] for layer in model.layers if isinstance(layer.mlp, SparseMoE)}
        assert held == {model.config.num_experts // tp if whole_experts else model.config.num_experts}
    runner = ModelRunner(model, max_len=64, device=CPU, use_cuda_graph=False)
    runner.reset()
    vocab = model.config.vocab_size  # token ids below are taken modulo it
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    prefill = runner.prefill(prompt)[0]
    decode = runner.decode(torch.tensor([5]), PROMPT_LEN)[0]
    cache_len = PROMPT_LEN + 1
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6, 7])
    tokens = torch.tensor([11, 3, 40, 8, 99, 17, 64, 2, 150]) % vocab
    tree = TreeSpec.build(tokens.view(1, -1), parents.view(1, -1), cache_len=cache_len)
    path = [0, 1, 3, 6, 7, 8]
    accepted = torch.zeros(1, 9, dtype=torch.bool)
    accepted[0, path] = True
    path_indices = torch.full((1, 16), -1, dtype=torch.long)
    path_indices[0, : len(path)] = torch.tensor(path)
    with torch.inference_mode():
        hidden, _, saved = model.verify(tree, runner.cache, cache_len)
        verify = model.logits(hidden[0])
        model.commit(runner.cache, cache_len, tree, saved, accepted, path_indices)
    after = runner.decode(torch.tensor([21 % vocab]), cache_len + len(path))[0]
    return {"prefill": prefill, "decode": decode, "verify": verify, "after commit": after}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("arch, tp, fused_experts, whole_experts", [
    ("llama", 2, False, False), ("llama", 4, False, False), ("qwen3", 2, False, False),
    ("qwen3_5_text", 2, False, False), ("qwen3_next", 2, False, False), ("qwen3_5_moe_text", 2, False, False),
    ("qwen3_next_moe", 2, True, False), ("qwen3_5_moe_text", 2, False, True), ("qwen3_next_moe", 2, True, True)])
def test_sharded_target_matches_tp1(arch: str, tp: int, fused_experts: bool, whole_experts: bool, tmp_path) -> None:
    """At tp 4 llama's 2 KV heads are replicated (one per rank pair). The hybrids have 2 GDN key heads, so they
    run at tp 2 at most. With expert parallelism (`whole_experts`) each rank holds 4 of the 8 experts whole,
    read from per-expert tensors or from rows of the fused stacks."""
    _, path = save_hf_model(arch, tmp_path)
    if fused_experts:
        path = fuse_experts(path, tmp_path / "fused")
    expected = passes(0, 1, str(path))
    ranks = run_ranks(tp, passes, str(path), whole_experts)
    for name, logits in expected.items():
        assert rel_err(ranks[0][name], logits) <= 1e-5, name
        assert all(torch.equal(got[name], ranks[0][name]) for got in ranks), f"{name}: the ranks disagree"
