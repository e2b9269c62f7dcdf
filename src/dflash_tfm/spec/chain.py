"""The DFLASH proposal: a chain of the drafter's argmax at every depth (no tree)."""
from __future__ import annotations

import torch


def build_chain(root_token: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """root_token (0-dim or [1] long) + argmax of logits [K, V] at depths 1…K.

    Returns tokens, parents, depths, each ``[K + 1]`` long on the logits' device; node i has parent i − 1.
    No host sync, static shapes.
    """
    depths = torch.arange(logits.shape[0] + 1, device=logits.device)
    tokens = torch.cat([root_token.reshape(1).to(device=logits.device, dtype=torch.long), logits.argmax(-1)])
    return tokens, depths - 1, depths
