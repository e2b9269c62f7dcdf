"""RMS norms in the exact numerics of the reference implementations (statistics in fp32)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dim.

    `plus_one=True` is the Qwen3.5/Qwen3-Next zero-centred form `norm(x) * (1 + w)` computed in fp32;
    otherwise the Llama/Qwen3 form `w * norm(x).to(dtype)`. Both keep the transformers rounding order so
    bf16 outputs match the parity oracle as closely as possible.
    """

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: `w * rmsnorm(x) * silu(gate)` with plain w, norm before gate."""
    dtype = gate.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)
