"""RMS norms in the exact numerics of the reference implementations (`kernels/norm/reference.py`), as modules and
as compiled functions."""
from __future__ import annotations

import torch
from torch import nn

from dflash_tfm.kernels.norm import reference
from dflash_tfm.kernels.norm.add_rms_norm import MAX_WIDTH, add_rms_norm_rows
from dflash_tfm.layers.compile import fuse_on_cuda, small_enough_to_fuse


# Each one compiled function on CUDA (one or two kernels instead of a chain of element-wise ones).
rms_norm = fuse_on_cuda(reference.rms_norm)
add_rms_norm = fuse_on_cuda(reference.add_rms_norm)
gated_rms_norm = fuse_on_cuda(reference.gated_rms_norm)


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
        """(h + delta, norm(h + delta)). On CUDA without autograd, for up to a verify's rows, one Triton program
        per row (`kernels/norm/add_rms_norm.py`): on the H200 it beat inductor's two-pass kernel at every row
        count timed (1 to 129 rows of 5120: 0.0020–0.0029 against 0.0024–0.0031 ms;
        docs/data/perf/verify_step_h200_2026-12-0[34]*.json). Otherwise inductor's fused add + norm (eager on the CPU)."""
        differentiable = torch.is_grad_enabled() and (h.requires_grad or delta.requires_grad or self.weight.requires_grad)
        if differentiable or not (h.is_cuda and small_enough_to_fuse(h, count_rows=True)
                                  and h.shape[-1] <= MAX_WIDTH and delta.dtype == h.dtype):
            return add_rms_norm(h, delta, self.weight, self.eps, self.plus_one)
        return add_rms_norm_rows(h, delta, self.weight, self.eps, self.plus_one)

