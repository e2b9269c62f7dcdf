"""RMS norms in the exact numerics of the reference implementations (statistics in fp32): the twins of the norm
kernels, and what `layers/norm.py` runs (compiled by inductor on CUDA)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
    """`plus_one`: Qwen3.5/Qwen3-Next zero-centred form `norm(x) * (1 + w)` in fp32; otherwise the
    Llama/Qwen3 form `w * norm(x).to(dtype)`. Both keep the transformers rounding order."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with the next norm: returns (h + delta, rms_norm(h + delta))."""
    h = h + delta
    return h, rms_norm(h, weight, eps, plus_one)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: `w * rmsnorm(x) * silu(gate)` with plain w, norm before gate."""
    dtype = gate.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)
