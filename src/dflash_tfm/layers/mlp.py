"""SwiGLU feed-forward with gate and up fused into one matrix (one GEMV at decode instead of two)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_tfm.layers.compile import fuse_on_cuda
from dflash_tfm.layers.linear import linear, projection_weight


@fuse_on_cuda
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] laid out [gate | up] -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`; `gate_up` holds the gate rows then the up rows."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up = projection_weight(2 * intermediate_size, hidden_size)
        self.down = projection_weight(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(silu_and_mul(linear(x, self.gate_up)), self.down)
