"""Our target models against `transformers` on tiny random configs (fp32, relative error <= 1e-4).

Covers the Qwen3.5 hybrid (bare text config and the vision-language wrapper), its mixture-of-experts sibling
Qwen3.5-MoE (both forms), Qwen3-Next's fused GDN projections with dense layers only and with sparse layers mixed
with a dense one (`mlp_only_layers`, top-k probabilities not renormalised), llama (tied embeddings) and qwen3;
grouped values (HV = 3 HK), partial rotary factors other than 0.25, prompts longer than one GDN chunk, and
step-by-step decode (MoE layers: experts gathered per token at decode, grouped by expert at prefill).
"""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.loading.loader import build_model, load_weights, open_checkpoint

from .tiny_targets import MOE_LAYERS, VOCAB, hf_logits, save_hf_model

ARCHS = ["qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next", "qwen3_next_moe", "llama", "qwen3"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=ARCHS)
def target(request, tmp_path_factory):
    hf_model, path = save_hf_model(request.param, tmp_path_factory.mktemp("ckpt"))
    source, raw, _ = open_checkpoint(path)
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, torch.device("cpu"), torch.float32, max_positions=512)
    load_weights(model, source, cfg, progress=False)
    return request.param, hf_model, model, cfg


def test_config_is_parsed(target):
    arch, hf_model, _, cfg = target
    if arch.startswith(("qwen3_5", "qwen3_next")):
        assert cfg.is_hybrid and cfg.linear_num_value_heads == 3 * cfg.linear_num_key_heads
        assert cfg.layer_types[2] == "full_attention"
    else:
        assert not cfg.is_hybrid
    assert cfg.moe_layers == MOE_LAYERS.get(arch, [])
    if cfg.moe_layers:
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
        assert cfg.norm_topk_prob == (arch != "qwen3_next_moe")


def test_prefill_logits_match_transformers(target):
    """All-position logits of one prefill over 150 tokens (> 2 GDN chunks of 64)."""
    _, hf_model, model, _ = target
    ids = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(1))
    runner = ModelRunner(model, max_len=256, device=torch.device("cpu"), use_cuda_graph=False)
    positions = torch.arange(150).view(1, -1)
    with torch.inference_mode():
        hidden, _ = model(ids.view(1, -1), positions, runner.cache, kv_len=150)
        ours = model.logits(hidden[0])
    assert rel_err(ours, hf_logits(hf_model, ids)) <= 1e-4


def test_chunked_prefill_then_decode_match_transformers(target):
    """Prefill in two chunks, then decode token by token: logits at step t == full-prefill logits at t."""
    _, hf_model, model, _ = target
    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf_model, ids)
    runner = ModelRunner(model, max_len=256, device=torch.device("cpu"), use_cuda_graph=False, prefill_chunk=48)
    runner.reset()
    last, _ = runner.prefill(ids[:80])
    assert rel_err(last, ref[79]) <= 1e-4
    for t in range(80, 100):
        logits = runner.decode(ids[t : t + 1], position=t)
        assert rel_err(logits[0], ref[t]) <= 1e-4, f"decode step at position {t}"


def test_reset_starts_a_fresh_sequence(target):
    """A second request on the same runner must not see the first one's recurrent state or keys."""
    _, hf_model, model, _ = target
    gen = torch.Generator().manual_seed(3)
    first, second = torch.randint(0, VOCAB, (40,), generator=gen), torch.randint(0, VOCAB, (30,), generator=gen)
    runner = ModelRunner(model, max_len=256, device=torch.device("cpu"), use_cuda_graph=False)
    runner.reset()
    runner.prefill(first)
    runner.reset()
    assert rel_err(runner.prefill(second)[0], hf_logits(hf_model, second)[-1]) <= 1e-4
