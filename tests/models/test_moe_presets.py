"""The Qwen3.5-35B-A3B preset (for GPU timing with random weights) has transformers' default shapes and 35B
parameters of which about 3B are active per token; random weights fill mixture-of-experts layers sanely."""
from __future__ import annotations

import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.presets import QWEN3_5_35B_A3B
from dflash_tfm.models.random_init import init_random_

AS_RELEASED = {"model_type", "rope_parameters", "max_position_embeddings", "full_attention_interval"}


def test_35b_a3b_preset_has_the_transformers_default_shapes() -> None:
    import transformers as tf

    default = tf.Qwen3_5MoeTextConfig()
    for key, value in QWEN3_5_35B_A3B.items():
        if key not in AS_RELEASED:
            assert getattr(default, key) == value, key
    cfg = ModelConfig.from_dict(QWEN3_5_35B_A3B)
    assert cfg.layer_types == default.layer_types
    assert cfg.partial_rotary_factor == default.rope_parameters["partial_rotary_factor"]
    assert cfg.moe_layers == list(range(40)) and cfg.intermediate_size == 0 and cfg.norm_topk_prob
    assert cfg.active_ffn_width == 8 * 512 + 512


def test_35b_a3b_has_35b_parameters_3b_active() -> None:
    cfg = ModelConfig.from_dict(QWEN3_5_35B_A3B)
    model = build_model(cfg, torch.device("meta"), torch.bfloat16, max_positions=16)
    total = sum(p.numel() for p in model.parameters())
    idle_experts = cfg.num_layers * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * 512 * 2048
    assert 34.5e9 < total < 35e9
    assert 2.5e9 < total - idle_experts - model.embed_tokens.numel() < 3.5e9  # embeddings are a lookup


def test_random_weights_spread_tokens_over_the_experts() -> None:
    shape = dict(QWEN3_5_35B_A3B, hidden_size=64, num_hidden_layers=4, vocab_size=128, num_attention_heads=2,
                 head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32)
    cfg = ModelConfig.from_dict(shape)
    model = init_random_(build_model(cfg, torch.device("cpu"), torch.float32, max_positions=64), seed=1)
    moe = model.layers[0].mlp
    for stack, fan_in in ((moe.experts_gate_up, 64), (moe.experts_down, 32)):
        per_expert_std = stack.flatten(1).std(dim=1)
        assert torch.allclose(per_expert_std, torch.full_like(per_expert_std, fan_in ** -0.5), rtol=0.1)
    x = model.layers[0].post_norm(torch.randn(256, 64, generator=torch.Generator().manual_seed(2)))
    out = moe(x)
    assert out.isfinite().all() and 0.1 < float(out.std()) < 10
    top1 = (x @ moe.in_proj[: cfg.num_experts].T).argmax(-1)
    assert top1.unique().numel() >= cfg.num_experts // 2
