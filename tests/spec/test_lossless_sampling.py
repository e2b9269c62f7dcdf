"""Sampling is lossless: speculative decoding at temperature > 0 emits tokens distributed exactly as the
target's own sampling (after temperature / top-k / top-p), whatever the drafter proposes.

Tiny targets with a 6-token vocabulary, one dense and one mixture of experts (Qwen3.5-MoE layout: Gated
DeltaNet and attention layers, 4 experts, top-2, a shared expert), make the exact distribution of the first three
generated tokens computable (216 outcomes) and random drafts frequently accepted (trees cover most of the
vocabulary). A chi-square test compares many seeded generations with it; a deliberately biased acceptance rule
(taking the target's argmax instead of a sample below the root) must fail the same test.
"""
from __future__ import annotations

import math

import pytest
import torch

import dflash_tfm.engine.speculative as speculative
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.decoder_factory import build_decoder
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.sampling import processed_probs
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.accept import target_draws
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from tests import spec_config
from tests.spec.test_speculative_decoding import CyclingBudget

V = 6
PROMPT = [1, 4, 2, 5, 3]
RUNS = 800
DENSE = dict(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
             max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0)
MOE = dict({k: v for k, v in DENSE.items() if k not in ("intermediate_size", "rope_theta")},
           model_type="qwen3_5_moe_text", layer_types=["linear_attention", "full_attention"],
           linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
TARGETS = {"dense": DENSE, "moe": MOE}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def setup(request, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny steps: thread hand-offs would dominate
    cfg = ModelConfig.from_dict(TARGETS[request.param])
    model = init_random_(build_model(cfg, torch.device("cpu"), torch.float32, max_positions=256), seed=11)
    root = tmp_path_factory.mktemp("lossless")
    write_random_dflash_checkpoint(root / "dflash", cfg, num_layers=1, block_size=16, target_layer_ids=[0, 1])
    write_random_weaver_checkpoint(root / "weaver.pth", cfg, variant=1)
    yield cfg, model, root
    torch.set_num_threads(threads)


def exact_distribution(model, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] under plain target sampling."""
    runner = ModelRunner(model, max_len=64, device=torch.device("cpu"), use_cuda_graph=False)

    def probs(prefix: list[int]) -> torch.Tensor:
        runner.reset()
        return processed_probs(runner.prefill(torch.tensor(prefix))[0].view(1, -1), params)[0]

    p1 = probs(PROMPT)
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    for a in range(V):
        p2 = probs(PROMPT + [a])
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * probs(PROMPT + [a, b])
    return joint


def sample_counts(decoder, params: SamplingParams) -> torch.Tensor:
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    for seed in range(RUNS):
        gen = torch.Generator().manual_seed(seed)
        tokens = [decoder.prefill(PROMPT, params, gen)]
        while len(tokens) < 3:
            tokens += decoder.step(params, gen)
        counts[tuple(tokens[:3])] += 1
    return counts


def chi_square_rejects(counts: torch.Tensor, expected_p: torch.Tensor, alpha_z: float = 3.09) -> tuple[bool, float, float]:
    """Pearson chi-square with bins of expected count < 5 pooled; rejects at p ~ 0.001 (Wilson-Hilferty)."""
    n = counts.sum()
    expected = (expected_p * n).flatten()
    observed = counts.flatten()
    small = expected < 5
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    k = int(keep.sum()) - 1
    crit = k * (1 - 2 / (9 * k) + alpha_z * math.sqrt(2 / (9 * k))) ** 3
    return stat > crit, stat, crit


CASES = [
    ("DFLASH", 1, SamplingParams(temperature=1.0)),
    ("DDTREE", 8, SamplingParams(temperature=0.8, top_k=4, top_p=0.9)),
    ("DFLASH_TFM", 16, SamplingParams(temperature=1.0)),
    ("DFLASH_TFM", 8, SamplingParams(temperature=1.3, top_p=0.85)),
    ("DFLASH_TFM", "auto", SamplingParams(temperature=1.0)),  # sizes chosen per step from the history
    ("DDTREE", "cycled", SamplingParams(temperature=0.9, top_p=0.95)),  # every size in turn, 0 included
]


@pytest.mark.parametrize("algo, budget, params", CASES, ids=[f"{a}-{b}-{p.temperature}" for a, b, p in CASES])
def test_generated_tokens_follow_the_target_distribution(setup, algo: str, budget, params: SamplingParams) -> None:
    cfg, model, root = setup
    runner = ModelRunner(model, max_len=128, device=torch.device("cpu"), use_cuda_graph=False)
    decoder = build_decoder(runner, cfg, spec_config(algo, root, "auto" if budget == "cycled" else budget))
    if budget == "cycled":
        decoder.budget = CyclingBudget(sorted(decoder.budget.step_seconds))
    counts = sample_counts(decoder, params)
    rejected, stat, crit = chi_square_rejects(counts, exact_distribution(model, params))
    assert not rejected, f"chi2 {stat:.1f} > {crit:.1f}"


def test_a_biased_acceptance_rule_is_detected(setup, monkeypatch) -> None:
    """Negative control: below the root, take the target's argmax instead of a sample (a plausible bug)."""
    cfg, model, root = setup

    def biased(logits, params, uniforms):
        draws = target_draws(logits, params, uniforms)
        draws[1:] = logits[1:].argmax(-1)
        return draws

    monkeypatch.setattr(speculative, "target_draws", biased)
    params = SamplingParams(temperature=1.0)
    runner = ModelRunner(model, max_len=128, device=torch.device("cpu"), use_cuda_graph=False)
    decoder = build_decoder(runner, cfg, spec_config("DDTREE", root, 8))
    rejected, stat, crit = chi_square_rejects(sample_counts(decoder, params), exact_distribution(model, params))
    assert rejected, f"biased rule not detected: chi2 {stat:.1f} <= {crit:.1f}"
