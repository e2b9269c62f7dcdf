"""Random but numerically sane weights, for timing real shapes and for test fixtures without checkpoints."""
from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter in place: matrices ~ N(0, 1/fan_in), norm weights ~ N(0, 0.1) (around the (1+w) or w
    identity), GDN decay parameters in their trained ranges so the recurrence neither explodes nor vanishes.
    Fan-in is the last dim, so stacked expert weights ([E, out, in]) get the per-expert scale of a dense layer, and
    the router rows of a mixture of experts give logits of about unit scale, spreading tokens over the experts."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(1.0, 16.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.fill_(1.0)
        elif p.dim() == 1:
            base = 0.0 if getattr(_owner(model, name), "plus_one", True) else 1.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen, device=p.device))
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    return model


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    module_name = param_name.rpartition(".")[0]
    return model.get_submodule(module_name) if module_name else model
