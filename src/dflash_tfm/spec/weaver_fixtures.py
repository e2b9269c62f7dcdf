"""Random Weaver checkpoints in the exact published ``torch.save`` format, for tests and benchmarks.

Variant 1 writes the current config (``activation: "swiglu"``, ``rope_base``); variants 2/3 write the older
config without those keys (the original class of that era did not accept them). Variants 2 and 3 written with
the same seed hold the same weights: variant 3's ``q_proj/k_proj/v_proj`` are variant 2's ``qkv_proj`` rows.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dflash_tfm.config import ModelConfig


def write_random_weaver_checkpoint(
    path: str | Path, target_cfg: ModelConfig, variant: int = 1, d_rank: int = 64, num_heads: int = 4, mlp_dim: int = 128,
    num_layers: int = 1, K: int = 15, pool: int = 512, seed: int = 0,
) -> dict:
    """Write ``{"config", "state_dict", "metadata"}`` to ``path`` and return that payload.

    ``target_cfg.hidden_size`` sets ``d_model`` and ``d_embed`` (our targets embed at the hidden width). Weights
    are fp32: matrices ~ N(0, 1/fan_in), norm weights 1 + N(0, 0.1), biases N(0, 0.1), ``pos_emb`` N(0, 0.25) so
    that every term visibly matters in parity tests.
    """
    if variant not in (1, 2, 3):
        raise ValueError(f"variant must be 1, 2 or 3, got {variant}")
    gen = torch.Generator().manual_seed(seed)
    d_model = d_embed = target_cfg.hidden_size

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    def vec(n: int, base: float = 0.0) -> torch.Tensor:
        return base + 0.1 * torch.randn(n, generator=gen)

    sd: dict[str, torch.Tensor] = {}
    for name, dim in (("output_norm", d_model), ("embed_norm", d_embed)):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = vec(dim, 1.0), vec(dim)
    sd["token_in.weight"], sd["token_in.bias"] = mat(d_rank, d_embed), vec(d_rank)
    sd["proposal_in.weight"], sd["proposal_in.bias"] = mat(d_rank, d_model), vec(d_rank)
    for i in range(num_layers):
        b = f"blocks.{i}."
        sd[b + "norm_attn.weight"], sd[b + "norm_attn.bias"] = vec(d_rank, 1.0), vec(d_rank)
        qkv = mat(3 * d_rank, d_rank)
        if variant == 3:
            for part, rows in zip("qkv", qkv.chunk(3, 0)):
                sd[f"{b}{part}_proj.weight"] = rows.clone()
        else:
            sd[b + "qkv_proj.weight"] = qkv
        sd[b + "o_proj.weight"] = mat(d_rank, d_rank)
        sd[b + "norm_mlp.weight"], sd[b + "norm_mlp.bias"] = vec(d_rank, 1.0), vec(d_rank)
        up, down = ("gate_up_proj", "down_proj") if variant == 1 else ("fc1", "fc2")
        width = 2 * mlp_dim if variant == 1 else mlp_dim
        sd[f"{b}{up}.weight"], sd[f"{b}{up}.bias"] = mat(width, d_rank), vec(width)
        sd[f"{b}{down}.weight"], sd[f"{b}{down}.bias"] = mat(d_rank, mlp_dim), vec(d_rank)
    sd["out_norm.weight"], sd["out_norm.bias"] = vec(d_rank, 1.0), vec(d_rank)
    sd["lm_head_query_in.weight"] = mat(d_model, d_rank)
    if variant != 1:
        sd["pos_emb"] = 0.25 * torch.randn(K, d_rank, generator=gen)

    config = dict(d_model=d_model, d_embed=d_embed, d_rank=d_rank, num_layers=num_layers, num_heads=num_heads,
                  mlp_dim=mlp_dim, K=K, candidate_pool_size=pool, encoder_mode=3, score_head=4)
    if variant == 1:
        config.update(activation="swiglu", rope_base=10000.0)
    payload = {"config": config, "state_dict": sd, "metadata": {"speculator_kind": "dflash_tfm_weaver"}}
    torch.save(payload, Path(path))
    return payload
