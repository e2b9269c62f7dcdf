"""The decode-step GEMV with its input fused in (add + RMSNorm -> GEMV) against its twin, the unfused layers' own
ops (Triton's interpreter on the CPU, 27B shapes on the GPU)."""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.kernels.linear.fused_gemv import add_norm_gemv, add_norm_gemv_reference

from .test_tree_common import rel_err, triton_device  # noqa: F401  (fixture)


def rows(*shape: int, device: str, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(device=device, dtype=dtype) for s in shape]


@pytest.mark.parametrize("plus_one", [True, False])
# bf16: both sides round every output (and the CPU twin's bf16 matmul its accumulation): semantics are
# pinned by the fp32 case, the bf16 case checks the dtype plumbing.
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_triton_add_norm_gemv_matches_twin(plus_one: bool, dtype: torch.dtype, tol: float, triton_device: str) -> None:
    K, N = 200, 40  # neither a multiple of the blocks
    h, delta = (t.view(1, 1, K) for t in rows((K,), (K,), device=triton_device, dtype=dtype, seed=1))
    norm_w, = rows((K,), device=triton_device, dtype=dtype, seed=2)
    w, = rows((N, K), device=triton_device, dtype=dtype, seed=3)
    h_new, y = add_norm_gemv(h, delta, norm_w * 0.1, 1e-6, plus_one, w, block_n=16, block_k=64)
    h_ref, y_ref = add_norm_gemv_reference(h, delta, norm_w * 0.1, 1e-6, plus_one, w)
    assert h_new.shape == h.shape and y.shape == (1, 1, N)
    assert rel_err(h_new, h_ref) <= tol / 3 and rel_err(y, y_ref) <= tol  # (h: exact in fp32, 1 ulp in bf16)


def test_triton_kernel_takes_one_row_only(triton_device: str) -> None:
    h = torch.randn(2, 8, device=triton_device)
    with pytest.raises(ValueError, match="one contiguous row"):
        add_norm_gemv(h, h, torch.ones(8, device=triton_device), 1e-6, True, torch.randn(3, 8, device=triton_device))


@pytest.mark.gpu
def test_gpu_fused_gemv_matches_twin_27b_shapes() -> None:
    """Qwen3.6-27B's MLP gate_up (hidden 5120, intermediate 17408), bf16, (1 + w) norm."""
    h, delta, norm_w = (torch.randn(1, 1, 5120, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    w_gu = torch.randn(34816, 5120, device="cuda", dtype=torch.bfloat16) / 5120**0.5
    h_new, gate_up = add_norm_gemv(h, delta, norm_w * 0.1, 1e-6, True, w_gu)
    h_ref, gate_up_ref = add_norm_gemv_reference(h, delta, norm_w * 0.1, 1e-6, True, w_gu)
    assert rel_err(h_new, h_ref) <= 1e-2 and rel_err(gate_up, gate_up_ref) <= 1e-2
