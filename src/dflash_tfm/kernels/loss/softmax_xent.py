"""Cross-entropy and its gradient over a large vocabulary in one pass over the logits, written in place.

The drafter's training loss is a cross-entropy over the target's whole vocabulary (49,152 for SmolLM2) for ~30k
block positions a step. Through ``F.cross_entropy`` on fp32 logits that is a 6 GB fp32 copy of the logits, a
log-softmax forward writing another 6 GB, and a softmax backward reading both and writing a third: ~11 ms of the
H200's ~58 ms step in the kernel profile (``bench_training_step --profile``), plus the casts. Here
one program per row reads the bf16 logits twice (online max / sum-exp, then the gradient) and overwrites them
with the gradient, so the lm_head's backward matmul reads them directly (``linear_cross_entropy.py``).

Twin: ``reference.softmax_xent_grad_reference_``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.loss import reference

FLOOR = -1e30  # the running maximum starts finite, so exp(m_old - m_new) of a lane that saw nothing is 0, not NaN


@triton.jit
def _softmax_xent_grad_kernel(logits, targets, scale, loss, V, stride, BLOCK: tl.constexpr, FLOOR: tl.constexpr):
    """Program = one row: lse = logsumexp(x) in fp32, loss = lse - x[t], x <- scale * (exp(x - lse) - [v == t])."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    m = tl.full([BLOCK], FLOOR, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
    t = tl.load(targets + row)
    tl.store(loss + row, lse - tl.load(base + t).to(tl.float32))
    c = tl.load(scale + row).to(tl.float32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(offs == t, 1.0, 0.0)) * c
        tl.store(base + offs, g.to(logits.dtype.element_ty), mask=offs < V)


def softmax_xent_grad_(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                       block: int = 4096) -> torch.Tensor:
    """Per-row cross-entropy fp32 ``[n]``; ``logits [n, V]`` (rows contiguous) become the gradient of
    ``sum_i scale_i * CE_i`` in place. ``targets [n]`` long, ``scale [n]`` fp32."""
    if logits.stride(-1) != 1:
        raise ValueError("softmax_xent_grad_ needs logits with contiguous rows")
    if not use_triton(logits):
        return reference.softmax_xent_grad_reference_(logits, targets, scale)
    n, V = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _softmax_xent_grad_kernel[(n,)](logits, targets, scale, loss, V, logits.stride(0),
                                        BLOCK=min(block, triton.next_power_of_2(V)), FLOOR=FLOOR, num_warps=8)
    return loss
