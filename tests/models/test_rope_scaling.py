"""RoPE scaling in the target against `transformers` (fp32, relative error <= 1e-4) on tiny random configs.

Every scaling type transformers implements for these models and the engine supports (yarn with its default and
explicit attention factors, linear, llama3, dynamic within max_position_embeddings) on a dense llama and the
Qwen3.5 hybrid, plus YaRN on Qwen3-Next and on the Qwen3.5 vision-language wrapper (the override Qwen documents
for contexts over 262k, on a 32-position original context here so 150 positions reach far past it). Prefill and
step-by-step decode both read the scaled tables. Unsupported types are refused by name; a config without
`partial_rotary_factor` gets each model class's default.
"""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.errors import CheckpointError
from dflash_tfm.loading.loader import build_model, load_weights, open_checkpoint
from dflash_tfm.rope_parameters import RopeParameters

from .tiny_targets import ATTN, BASE, GDN, VOCAB, hf_logits, perturb

ORIGINAL = 32
SCALINGS = {
    "yarn": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=ORIGINAL),
    "yarn_mscale": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=ORIGINAL, mscale=0.707,
                        mscale_all_dim=1.0, beta_fast=16, beta_slow=2, truncate=False),
    "yarn_attention_factor": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL,
                                  attention_factor=1.25),
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIGINAL),
    "dynamic": dict(rope_type="dynamic", factor=4.0),
}
CASES = [("llama", s) for s in SCALINGS] + [("qwen3_5_text", s) for s in SCALINGS] + [
    ("qwen3_next", "yarn"), ("qwen3_5", "yarn")]


def hf_model(arch: str, scaling: str):
    import transformers as tf

    rope = dict(SCALINGS[scaling], rope_theta=10000.0)
    hybrid = dict(**BASE, **ATTN, **GDN, num_hidden_layers=4, tie_word_embeddings=False,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    torch.manual_seed(0)
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**BASE, num_attention_heads=4, num_key_value_heads=2,
                                                   num_hidden_layers=2, rope_parameters=rope))
    elif arch == "qwen3_5_text":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**hybrid, rope_parameters=dict(rope, partial_rotary_factor=0.5)))
    elif arch == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**hybrid, num_experts=0, rope_parameters=rope,
                                                           partial_rotary_factor=0.5))
    else:  # the VL wrapper with Qwen's mrope fields next to the YaRN ones
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
        text = dict(hybrid, rope_parameters=dict(rope, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                                                 mrope_interleaved=True))
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision))
    return perturb(model)


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{s}" for a, s in CASES])
def pair(request, tmp_path_factory):
    arch, scaling = request.param
    model = hf_model(arch, scaling)
    path = tmp_path_factory.mktemp("rope") / arch
    model.save_pretrained(path, safe_serialization=True)
    source, raw, _ = open_checkpoint(path)
    cfg = ModelConfig.from_dict(raw)
    ours = build_model(cfg, torch.device("cpu"), torch.float32, max_positions=256)
    load_weights(ours, source, cfg, progress=False)
    return model, ours, cfg, scaling


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_config_reads_the_scaling(pair):
    _, _, cfg, scaling = pair
    assert cfg.rope.rope_type == SCALINGS[scaling]["rope_type"]
    assert cfg.rope.factor == SCALINGS[scaling]["factor"]


def test_prefill_and_decode_logits_match_transformers(pair):
    """150-token prefill (positions far past the 32-position original context), then 20 decode steps."""
    hf, ours, _, _ = pair
    ids = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(hf, ids)
    runner = ModelRunner(ours, max_len=256, device=torch.device("cpu"), use_cuda_graph=False)
    with torch.inference_mode():
        hidden, _ = ours(ids[:130].view(1, -1), torch.arange(130).view(1, -1), runner.cache, kv_len=130)
        assert rel_err(ours.logits(hidden[0]), ref[:130]) <= 1e-4
        for t in range(130, 150):
            logits = runner.decode(ids[t : t + 1], position=t)
            assert rel_err(logits[0], ref[t]) <= 1e-4, f"decode step at position {t}"


def test_partial_rotary_factor_defaults_follow_transformers():
    """Without the field the hybrids rotate a quarter of the head dim (transformers' class default), the dense
    models all of it."""
    hybrid = dict(BASE, **ATTN, **GDN, num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    for model_type in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     shared_expert_intermediate_size=16) if "moe" in model_type else {}
        assert ModelConfig.from_dict(dict(hybrid, **extra, model_type=model_type)).partial_rotary_factor == 0.25
    assert ModelConfig.from_dict(dict(BASE, model_type="llama", num_hidden_layers=2,
                                      num_attention_heads=4)).partial_rotary_factor == 1.0


def test_missing_fields_take_the_model_class_defaults():
    """head_dim, KV heads and context length as transformers' config classes default them."""
    import transformers as tf

    minimal = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    for model_type, hf_class in (("llama", tf.LlamaConfig), ("qwen3", tf.Qwen3Config)):
        ours, theirs = ModelConfig.from_dict(dict(minimal, model_type=model_type)), hf_class(**minimal)
        assert (ours.head_dim, ours.num_kv_heads, ours.max_position_embeddings) == (
            theirs.head_dim, theirs.num_key_value_heads, theirs.max_position_embeddings)
    ours = ModelConfig.from_dict(dict(minimal, model_type="qwen3_5_text"))
    theirs = tf.Qwen3_5TextConfig(**minimal)
    assert (ours.head_dim, ours.num_kv_heads, ours.linear_num_value_heads, ours.linear_key_head_dim) == (
        theirs.head_dim, theirs.num_key_value_heads, theirs.linear_num_value_heads, theirs.linear_key_head_dim)


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "longrope"),
    ({"rope_type": "proportional"}, "proportional"),
    ({"rope_type": "su"}, "'su'"),
    ({"rope_type": "yarn"}, "needs a 'factor'"),
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
])
def test_unsupported_rope_is_refused_by_name(rope, match):
    with pytest.raises(CheckpointError, match=match):
        ModelConfig.from_dict(dict(BASE, model_type="llama", num_hidden_layers=2, num_attention_heads=4,
                                   rope_parameters=rope))


def test_legacy_rope_scaling_and_dynamic_table_limit():
    """`rope_scaling` (legacy `type` key) replaces `rope_parameters` as in transformers; dynamic NTK tables stop
    at max_position_embeddings, past which transformers would change the frequencies."""
    raw = dict(BASE, model_type="llama", num_hidden_layers=2, num_attention_heads=4, rope_theta=5e5,
               rope_scaling={"type": "dynamic", "factor": 2.0})
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.rope.rope_type, cfg.rope_theta, cfg.rope.factor) == ("dynamic", 5e5, 2.0)
    build_model(cfg, torch.device("meta"), torch.float32, max_positions=cfg.max_position_embeddings)
    with pytest.raises(ValueError, match="dynamic"):
        build_model(cfg, torch.device("meta"), torch.float32, max_positions=cfg.max_position_embeddings + 1)
    assert RopeParameters.from_config({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, 4096) \
        .original_max_position_embeddings == 4096
