"""The DFLASH proposal: a chain of the drafter's argmax at every depth (no tree)."""
from __future__ import annotations

import torch


def build_chain(root_token: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """root_token + argmax of logits [..., K, V] at depths 1…K; with leading dims, one chain per index
    (root_token [...]: a batch's rows at once), else root_token 0-dim or [1].

    Returns tokens, parents, depths, each ``[..., K + 1]`` long on the logits' device; node i has parent i − 1.
    No host sync, static shapes.
    """
    lead = logits.shape[:-2]
    depths = torch.arange(logits.shape[-2] + 1, device=logits.device).expand(*lead, -1)
    root = root_token.reshape(*lead, 1).to(device=logits.device, dtype=torch.long)
    return torch.cat([root, logits.argmax(-1)], -1), depths - 1, depths
