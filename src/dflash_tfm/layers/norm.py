"""RMS norms in the exact numerics of the reference implementations (statistics in fp32)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_tfm.layers.compile import fuse_on_cuda


@fuse_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
    """`plus_one`: Qwen3.5/Qwen3-Next zero-centred form `norm(x) * (1 + w)` in fp32; otherwise the
    Llama/Qwen3 form `w * norm(x).to(dtype)`. Both keep the transformers rounding order."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


@fuse_on_cuda
def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with the next norm: returns (h + delta, rms_norm(h + delta))."""
    h = h + delta
    return h, rms_norm.__wrapped__(h, weight, eps, plus_one)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (see `rms_norm`)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.plus_one)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(h, delta, self.weight, self.eps, self.plus_one)


@fuse_on_cuda
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: `w * rmsnorm(x) * silu(gate)` with plain w, norm before gate."""
    dtype = gate.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)
