"""RMS norms in the exact numerics of the reference implementations (statistics in fp32)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_tfm.kernels.norm.add_rms_norm import MAX_WIDTH, add_rms_norm_rows
from dflash_tfm.layers.compile import fuse_on_cuda, small_enough_to_fuse
from dflash_tfm.layers.measured_choice import MeasuredChoice

# Residual add + norm of a few rows: inductor's fused kernel, or one Triton program per row
# (`kernels/norm/add_rms_norm.py`), whichever measured faster for the shape.
add_norm_rows_choice = MeasuredChoice(default="inductor")


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
        """(h + delta, norm(h + delta)). On CUDA without autograd, for up to a verify's rows, the one-pass
        Triton kernel where it measured faster (`add_norm_rows_choice`)."""
        def inductor() -> tuple[torch.Tensor, torch.Tensor]:
            return add_rms_norm(h, delta, self.weight, self.eps, self.plus_one)

        def triton_rows() -> tuple[torch.Tensor, torch.Tensor]:
            return add_rms_norm_rows(h, delta, self.weight, self.eps, self.plus_one)

        differentiable = torch.is_grad_enabled() and (h.requires_grad or delta.requires_grad or self.weight.requires_grad)
        if differentiable or not (h.is_cuda and small_enough_to_fuse(h, count_rows=True)
                                  and h.shape[-1] <= MAX_WIDTH and delta.dtype == h.dtype):
            return inductor()
        key = (h.numel() // h.shape[-1], h.shape[-1], h.dtype, self.weight.dtype, self.plus_one)
        name = add_norm_rows_choice.pick(key, lambda: {"inductor": inductor, "triton rows": triton_rows})
        return triton_rows() if name == "triton rows" else inductor()


@fuse_on_cuda
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: `w * rmsnorm(x) * silu(gate)` with plain w, norm before gate."""
    dtype = gate.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)
