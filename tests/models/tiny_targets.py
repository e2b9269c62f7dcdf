"""Tiny random target checkpoints written with `transformers`, the parity oracle for our models.

Every architecture is saved with `save_pretrained` (real HF directory layout, safetensors), so the tests go
through the same loader users' checkpoints do. Weights are perturbed away from HF's init (norms at exactly
0 or 1 would hide a (1+w) vs w mistake).
"""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 160

GDN = dict(
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=512)


def _hybrid_text(partial_rotary_factor: float) -> dict:
    return dict(
        **BASE, **ATTN, **GDN, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor},
        tie_word_embeddings=False,
    )


def build_hf_model(arch: str):
    """A random tiny `transformers` model of `arch` in fp32 eval mode."""
    import transformers as tf

    torch.manual_seed(0)
    if arch == "qwen3_5_text":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**_hybrid_text(0.5)))
    elif arch == "qwen3_5":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
        cfg = tf.Qwen3_5Config(text_config=_hybrid_text(0.25), vision_config=vision)
        model = tf.Qwen3_5ForConditionalGeneration(cfg)
    elif arch == "qwen3_next":
        text = _hybrid_text(0.375)
        text.pop("rope_parameters")
        cfg = tf.Qwen3NextConfig(
            **text, num_experts=0, partial_rotary_factor=0.375, rope_theta=10000.0,
        )
        model = tf.Qwen3NextForCausalLM(cfg)
    elif arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**BASE, num_attention_heads=4, num_key_value_heads=2,
                                                   num_hidden_layers=3, tie_word_embeddings=True, rope_theta=10000.0))
    elif arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**BASE, **ATTN, num_hidden_layers=3, tie_word_embeddings=False))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 0.08)
    return model.float().eval()


def save_hf_model(arch: str, root: Path) -> tuple[object, Path]:
    model = build_hf_model(arch)
    path = root / arch
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids.view(1, -1)).logits[0].float()
