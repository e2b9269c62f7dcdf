"""Weighted cross-entropy of ``hidden @ W^T`` against token labels, with a frozen ``W``, chunk by chunk.

``F.cross_entropy(F.linear(h, W).float(), t)`` keeps the whole ``[n, V]`` fp32 logits (and their softmax) alive
for the backward pass. Here the gradient with respect to ``h`` is computed during the forward pass, one chunk of
rows at a time: logits in ``W``'s dtype, ``softmax_xent_grad_`` turns them into their own gradient in place,
and one matmul with ``W`` gives the rows' ``dL/dh``, kept for backward. Peak memory is one chunk's logits; the
loss and gradient are those of the plain expression (``tests/kernels/test_linear_cross_entropy.py``). ``W`` gets
no gradient: the drafter shares the target's lm_head, frozen.
"""
from __future__ import annotations

import torch

from dflash_tfm.kernels.loss.softmax_xent import softmax_xent_grad_


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, row_weights: torch.Tensor,
                chunk_rows: int) -> torch.Tensor:
        scale = (row_weights / row_weights.sum().clamp(min=1e-9)).float()
        h = hidden.detach().to(weight.dtype)
        grad = torch.empty_like(h)
        losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = h[rows] @ weight.T
            losses[rows] = softmax_xent_grad_(logits, targets[rows], scale[rows])
            torch.matmul(logits, weight, out=grad[rows])
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        return (losses * scale).sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(ctx.hidden_dtype), None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         row_weights: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """``sum_i w_i * CE(hidden_i @ weight^T, targets_i) / sum_i w_i``: hidden [n, H], weight [V, H] (no grad),
    targets [n] long in [0, V), row_weights [n] ≥ 0. Differentiable in ``hidden`` only."""
    if weight.requires_grad:
        raise ValueError("linear_cross_entropy computes no gradient for the weight: pass a frozen one")
    return _LinearCrossEntropy.apply(hidden, weight, targets, row_weights, chunk_rows)
