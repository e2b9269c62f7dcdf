"""SwiGLU feed-forward with gate and up fused into one matrix (one GEMV at decode instead of two)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`; `gate_up` holds the gate rows then the up rows."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)
