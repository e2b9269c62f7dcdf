"""Pure-PyTorch twin of ``softmax_xent.py``: it defines what the kernel computes and is what runs on the CPU."""
from __future__ import annotations

import torch


def softmax_xent_grad_reference_(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy fp32 ``[n]`` of ``logits [n, V]`` against ``targets [n]``; ``logits`` is overwritten
    (in its own dtype) with the loss's gradient for a total loss ``sum_i scale_i * CE_i``:
    ``scale_i * (softmax(logits_i) - onehot(t_i))``. Statistics in fp32 whatever the logits' dtype."""
    x = logits.float()
    lse = x.logsumexp(-1)
    loss = lse - x.gather(1, targets[:, None]).squeeze(1)
    grad = (x - lse[:, None]).exp_()
    grad.scatter_add_(1, targets[:, None], torch.full_like(lse[:, None], -1.0))
    logits.copy_(grad.mul_(scale[:, None].float()))
    return loss
