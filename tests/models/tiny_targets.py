"""Tiny random target checkpoints written with `transformers`, the parity oracle for our models.

Every architecture is saved with `save_pretrained` (real HF directory layout, safetensors), so the tests go
through the same loader users' checkpoints do. Weights are perturbed away from HF's init (norms at exactly
0 or 1 would hide a (1+w) vs w mistake). Mixture-of-experts targets have 8 experts, top-2, and a shared expert;
transformers saves their experts one tensor per expert, and `fuse_experts` rewrites a saved directory in the
fused layout ([E, 2I, H] / [E, H, I]) the Qwen3.5-MoE checkpoints are released in.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VOCAB = 160

GDN = dict(
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=512)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# Which layers are mixtures of experts in each MoE architecture below (the Qwen3-Next one keeps layer 1 dense).
MOE_LAYERS = {"qwen3_5_moe_text": [0, 1, 2, 3], "qwen3_5_moe": [0, 1, 2, 3], "qwen3_next_moe": [0, 2, 3]}


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
    elif arch == "qwen3_5_moe_text":
        text = {k: v for k, v in _hybrid_text(0.5).items() if k != "intermediate_size"}
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text, **MOE))
    elif arch == "qwen3_5_moe":
        text = {k: v for k, v in _hybrid_text(0.25).items() if k != "intermediate_size"}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
        cfg = tf.Qwen3_5MoeConfig(text_config=dict(text, **MOE), vision_config=vision)
        model = tf.Qwen3_5MoeForConditionalGeneration(cfg)
    elif arch in ("qwen3_next", "qwen3_next_moe"):
        text = _hybrid_text(0.375)
        text.pop("rope_parameters")
        # The MoE variant: layer 1 dense through mlp_only_layers, the top-k probabilities not renormalised.
        moe = dict(MOE, mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=False) if arch == "qwen3_next_moe" \
            else dict(num_experts=0)
        cfg = tf.Qwen3NextConfig(**text, **moe, partial_rotary_factor=0.375, rope_theta=10000.0)
        model = tf.Qwen3NextForCausalLM(cfg)
    elif arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**BASE, num_attention_heads=4, num_key_value_heads=2,
                                                   num_hidden_layers=3, tie_word_embeddings=True, rope_theta=10000.0))
    elif arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**BASE, **ATTN, num_hidden_layers=3, tie_word_embeddings=False))
    else:
        raise ValueError(arch)
    return perturb(model)


def perturb(model):
    """`model` with its weights moved away from HF's init (norms off 0 / 1, matrices ~ N(0, 0.08)), fp32, eval."""
    with torch.no_grad():
        for _, p in model.named_parameters():
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


PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def fuse_experts(src: Path, dst: Path) -> Path:
    """Copy the HF directory `src` to `dst` with every layer's per-expert tensors stacked into the fused layout:
    `experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and `experts.down_proj`
    [E, H, I]."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name in [n for n in tensors if PER_EXPERT.fullmatch(n)]:
        prefix, e, kind = PER_EXPERT.fullmatch(name).groups()
        experts.setdefault(prefix, {}).setdefault(kind, {})[int(e)] = tensors.pop(name)
    for prefix, kinds in experts.items():
        stack = lambda kind: torch.stack([kinds[kind][e] for e in sorted(kinds[kind])])  # noqa: E731
        tensors[f"{prefix}.gate_up_proj"] = torch.cat([stack("gate"), stack("up")], dim=1)
        tensors[f"{prefix}.down_proj"] = stack("down")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
