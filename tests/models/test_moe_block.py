"""The mixture-of-experts block (`layers/moe.py`) against transformers' Qwen3-Next sparse block (the same code as
Qwen3.5-MoE's, which always renormalises), and its two ways of running the routed experts against each other and
against a per-token loop."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_tfm.kernels.moe.reference import gathered_expert_outputs, grouped_expert_outputs
from dflash_tfm.layers.moe import SparseMoE, route

H, E, K, I, S = 64, 8, 2, 32, 48


def hf_block(norm_topk_prob: bool):
    import transformers as tf
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    torch.manual_seed(0)
    cfg = tf.Qwen3NextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                             shared_expert_intermediate_size=S, norm_topk_prob=norm_topk_prob)
    block = Qwen3NextSparseMoeBlock(cfg).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.1)
    return block


def ours_from(block, normalise: bool) -> SparseMoE:
    moe = SparseMoE(H, E, K, I, S, normalise).eval()
    shared = block.shared_expert
    with torch.no_grad():
        moe.in_proj.copy_(torch.cat([block.gate.weight, block.shared_expert_gate.weight,
                                     shared.gate_proj.weight, shared.up_proj.weight]))
        moe.shared_down.copy_(shared.down_proj.weight)
        moe.experts_gate_up.copy_(block.experts.gate_up_proj)
        moe.experts_down.copy_(block.experts.down_proj)
    return moe


@pytest.mark.parametrize("normalise", [True, False])
@pytest.mark.parametrize("tokens", [1, 3, 40])  # T · k <= E: gathered; 40 · 2 > 8: grouped by expert
def test_block_matches_transformers(normalise: bool, tokens: int) -> None:
    block = hf_block(normalise)
    x = torch.randn(1, tokens, H, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        expected = block(x)
        ours = ours_from(block, normalise)(x)
    assert float((ours - expected).norm() / expected.norm()) <= 1e-5


def per_token_loop(x, experts, gate_up, down) -> torch.Tensor:
    """The definition: assignment (t, j) is expert experts[t, j]'s SwiGLU of token t."""
    rows = []
    for t in range(x.shape[0]):
        for e in experts[t].tolist():
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            rows.append(down[e] @ (F.silu(gate) * up))
    return torch.stack(rows)


def test_gathered_and_grouped_outputs_equal_the_definition() -> None:
    """Many tokens, one expert never chosen (grouped skips it), tokens sharing experts in any order."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(37, H, generator=gen)
    experts = torch.stack([torch.randperm(E - 1, generator=gen)[:K] for _ in range(37)])  # expert E - 1 unused
    gate_up = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    down = torch.randn(E, H, I, generator=gen) / I ** 0.5
    expected = per_token_loop(x, experts, gate_up, down)
    for run in (gathered_expert_outputs, grouped_expert_outputs):
        assert torch.allclose(run(x, experts, gate_up, down), expected, atol=1e-5, rtol=1e-5), run.__name__


def test_route_takes_the_k_most_probable_experts() -> None:
    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(3))
    probs = logits.softmax(-1)
    for normalise in (True, False):
        weights, experts = route(logits, K, normalise)
        assert torch.equal(experts, probs.topk(K).indices)
        expected = probs.gather(1, experts)
        if normalise:
            expected = expected / expected.sum(-1, keepdim=True)
        assert weights.dtype == torch.float32 and torch.allclose(weights, expected)
