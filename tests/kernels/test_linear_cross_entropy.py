"""The drafter's fused cross-entropy: the in-place softmax/xent kernel against its twin (Triton's interpreter on
the CPU, compiled on a GPU), and `linear_cross_entropy`'s loss and gradient against the plain expression."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_tfm.kernels.loss.linear_cross_entropy import linear_cross_entropy
from dflash_tfm.kernels.loss.reference import softmax_xent_grad_reference_
from dflash_tfm.kernels.loss.softmax_xent import softmax_xent_grad_

from .test_tree_common import rel_err, triton_device  # noqa: F401  (fixture)


def plain_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the drafter trainer computed before: fp32 logits, per-row CE, weighted mean."""
    ce = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none")
    return (ce * w).sum() / w.sum()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_softmax_xent_grad_matches_twin(dtype: torch.dtype, tol: float, triton_device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    n, V = 7, 1000  # V not a multiple of the block: the last block is masked
    logits = (torch.randn(n, V, generator=gen) * 4).to(triton_device, dtype)
    logits[3, 17] = 40.0  # one peaked row
    targets = torch.randint(0, V, (n,), generator=gen).to(triton_device)
    targets[3] = 17
    scale = torch.rand(n, generator=gen).to(triton_device)
    scale[5] = 0.0
    want_grad = logits.clone()
    want_loss = softmax_xent_grad_reference_(want_grad, targets, scale)
    got_grad = logits.clone()
    got_loss = softmax_xent_grad_(got_grad, targets, scale, block=256)
    assert rel_err(got_loss, want_loss) < tol
    assert rel_err(got_grad, want_grad) < tol
    assert (got_grad[5] == 0).all()


def test_twin_is_the_cross_entropy_and_its_gradient() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 30, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 30, (5,), generator=gen)
    scale = torch.rand(5, generator=gen, dtype=torch.float64)
    ce = F.cross_entropy(logits, targets, reduction="none")
    (ce * scale).sum().backward()
    grad = logits.detach().clone()
    loss = softmax_xent_grad_reference_(grad, targets, scale)
    assert torch.allclose(loss.double(), ce.detach(), atol=1e-6)
    assert torch.allclose(grad, logits.grad, atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [3, 4096])
def test_linear_cross_entropy_matches_plain_expression(chunk_rows: int) -> None:
    gen = torch.Generator().manual_seed(2)
    n, H, V = 10, 16, 50
    hidden = torch.randn(n, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen)
    targets = torch.randint(0, V, (n,), generator=gen)
    w = torch.rand(n, generator=gen)
    w[2] = 0.0
    want = plain_loss(hidden, weight, targets, w)
    (want_grad,) = torch.autograd.grad(want * 3.0, hidden)
    got = linear_cross_entropy(hidden, weight, targets, w, chunk_rows=chunk_rows)
    (got_grad,) = torch.autograd.grad(got * 3.0, hidden)  # an upstream gradient other than 1
    assert rel_err(got, want) < 1e-5
    assert rel_err(got_grad, want_grad) < 1e-5


def test_linear_cross_entropy_refuses_a_trainable_weight() -> None:
    with pytest.raises(ValueError, match="frozen"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(3, 4, requires_grad=True), torch.tensor([0, 1]),
                             torch.ones(2))


@pytest.mark.gpu
def test_linear_cross_entropy_at_the_drafters_size_in_bf16() -> None:
    """SmolLM2's vocabulary and width, bf16 under autocast as the trainer runs it, against the plain expression."""
    gen = torch.Generator().manual_seed(3)
    n, H, V = 6000, 576, 49152
    hidden = torch.randn(n, H, generator=gen).cuda().requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.05).cuda().bfloat16()
    targets = torch.randint(0, V, (n,), generator=gen).cuda()
    w = torch.rand(n, generator=gen).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = plain_loss(hidden, weight, targets, w)
        got = linear_cross_entropy(hidden, weight, targets, w)
    (want_grad,) = torch.autograd.grad(want, hidden)
    (got_grad,) = torch.autograd.grad(got, hidden)
    assert rel_err(got, want) < 1e-3
    assert rel_err(got_grad, want_grad) < 2e-2
