"""The one-pass residual add + RMSNorm over rows against its twin `add_rms_norm`, what the layers run elsewhere
(Triton's interpreter on the CPU, a verify's 65 rows at 27B width on the GPU)."""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.kernels.norm.add_rms_norm import add_rms_norm_rows
from dflash_tfm.kernels.norm.reference import add_rms_norm

from .test_tree_common import rel_err, triton_device  # noqa: F401  (fixture)


def inputs(rows: int, K: int, dtype: torch.dtype, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    h, delta = (torch.randn(1, rows, K, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    return h, delta, (torch.randn(K, generator=gen) * 0.1).to(device=device, dtype=dtype)


@pytest.mark.parametrize("plus_one", [True, False])
# bf16: the sum and the outputs are rounded on both sides; a differently ordered fp32 sum of squares can move
# an output by one bf16 ulp.
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_triton_add_rms_norm_rows_matches_twin(plus_one: bool, dtype: torch.dtype, tol: float, triton_device: str) -> None:
    h, delta, w = inputs(5, 200, dtype, triton_device)  # K not a power of 2: masked tail
    h_new, y = add_rms_norm_rows(h, delta, w, 1e-6, plus_one)
    h_ref, y_ref = add_rms_norm(h, delta, w, 1e-6, plus_one)
    assert h_new.dtype == h_ref.dtype and y.dtype == y_ref.dtype and y.shape == y_ref.shape
    assert torch.equal(h_new, h_ref)  # one rounded add, the same on both sides
    assert rel_err(y, y_ref) <= tol


def test_triton_bad_shapes_are_refused(triton_device: str) -> None:
    h, delta, w = inputs(2, 64, torch.float32, triton_device)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm_rows(h, delta[..., :32], w, 1e-6, True)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm_rows(h, delta, w[:32], 1e-6, True)


@pytest.mark.gpu
@pytest.mark.parametrize("plus_one", [True, False])
def test_gpu_add_rms_norm_rows_27b_verify_shape(plus_one: bool) -> None:
    h, delta, w = inputs(65, 5120, torch.bfloat16, "cuda", seed=1)
    h_new, y = add_rms_norm_rows(h, delta, w, 1e-6, plus_one)
    h_ref, y_ref = add_rms_norm(h, delta, w, 1e-6, plus_one)
    assert torch.equal(h_new, h_ref) and rel_err(y, y_ref) <= 8e-3
