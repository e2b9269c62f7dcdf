"""The one-launch GDN verify inputs (tree conv + SiLU + q/k L2 norm + β, g) against the unfused composition.

The twin, ``gdn_tree_inputs_reference``, is ``split_projection`` + the tree conv twin + ``split_heads``: the
pieces the model-level tests check against transformers and the tree conv tests against plain decoding. Triton
kernels: see test_tree_common for how they run on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.kernels import TRITON_INTERPRETED
from dflash_tfm.kernels.gdn import tree_inputs
from dflash_tfm.kernels.gdn.tree_inputs import gdn_tree_inputs, gdn_tree_inputs_reference
from dflash_tfm.tree import random_parents

from .test_tree_common import rel_err, triton_device  # noqa: F401  (fixture)

NAMES = ("q", "k", "v", "z", "beta", "g")


def make_case(B: int, N: int, hk: int, dk: int, hv: int, dv: int, device: str, dtype: torch.dtype,
              pad: int = 0, shape: str = "random"):
    """A layer's in_proj output (as a view of a `pad`-wider buffer when pad > 0: rows not contiguous), conv
    weight, window, A_log, dt_bias and parents."""
    gen = torch.Generator().manual_seed(N + hk * dk + hv)
    C = 2 * hk * dk + hv * dv
    P = C + hv * dv + 2 * hv
    proj = (2 * torch.randn(B, N, P + pad, generator=gen))[..., :P]
    weight, window = torch.randn(C, 4, generator=gen), torch.randn(B, C, 3, generator=gen)
    A_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    proj[..., -hv:] += 25 * (torch.rand(B, N, hv, generator=gen) > 0.8)  # some a + dt_bias beyond softplus's 20
    parents = torch.stack([random_parents(N, shape, seed=b) for b in range(B)]).to(device)
    move = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return move(proj), move(weight), move(window), A_log.to(device), dt_bias.to(device), parents


def check(device: str, dtype: torch.dtype, tol: float, B: int, N: int, hk: int, dk: int, hv: int, dv: int,
          pad: int = 0, keep: bool = True, shape: str = "random") -> None:
    proj, weight, window, A_log, dt_bias, parents = make_case(B, N, hk, dk, hv, dv, device, dtype, pad, shape)
    window_before = window.clone()
    C = 2 * hk * dk + hv * dv
    kept = torch.full((B, N, C), float("nan"), dtype=dtype, device=device) if keep else None
    got = gdn_tree_inputs(proj, weight, A_log, dt_bias, parents, window, hk, dk, hv, dv, keep_input=kept)
    want = gdn_tree_inputs_reference(proj, weight, A_log, dt_bias, parents, window, hk, dk, hv, dv)
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))
    q, k = got[0].float(), got[1].float()
    assert torch.allclose(q.norm(dim=-1), torch.ones(()), atol=1e-2) and torch.allclose(k.norm(dim=-1), torch.ones(()),
                                                                                          atol=1e-2)
    if keep:
        assert torch.equal(kept, proj[..., :C])
    assert torch.equal(window, window_before)


@pytest.mark.parametrize("shape", ["chain", "random", "best_first"])
def test_triton_matches_twin_fp32(triton_device: str, shape: str) -> None:
    """Grouped values (HV = 3·HK), one channel block covering everything, rows of a wider buffer."""
    check(triton_device, torch.float32, 1e-5, B=2, N=9, hk=2, dk=16, hv=6, dv=8, pad=5, shape=shape)


def test_triton_several_blocks_and_a_block_across_k_and_v(triton_device: str, monkeypatch) -> None:
    """Channel blocks of 64 with q|k = 96 channels: block 1 holds the last k heads and the first v channels,
    so only its first groups are normalised."""
    monkeypatch.setattr(tree_inputs, "MAX_BLOCK", 64)
    check(triton_device, torch.float32, 1e-5, B=1, N=7, hk=3, dk=16, hv=6, dv=16, keep=False)


def test_triton_bf16_rounds_like_the_unfused_path(triton_device: str) -> None:
    check(triton_device, torch.bfloat16, 1e-2, B=1, N=17, hk=2, dk=32, hv=6, dv=16)


def test_dk_the_kernel_cannot_tile_runs_the_twin(triton_device: str) -> None:
    check(triton_device, torch.float32, 0.0, B=1, N=5, hk=2, dk=12, hv=6, dv=8)


def test_validation_errors() -> None:
    proj, weight, window, A_log, dt_bias, parents = make_case(1, 5, 2, 16, 6, 8, "cpu", torch.float32)
    args = (A_log, dt_bias, parents, window, 2, 16, 6, 8)
    with pytest.raises(ValueError, match="proj must be"):
        gdn_tree_inputs(proj[..., :-1], weight, *args)
    with pytest.raises(ValueError, match="conv_weight must be"):
        gdn_tree_inputs(proj, weight[:, :3], *args)
    with pytest.raises(ValueError, match="keep_input must be"):
        gdn_tree_inputs(proj, weight, *args, keep_input=torch.empty(1, 5, 3))
    with pytest.raises(ValueError, match="conv_window must be"):
        gdn_tree_inputs(proj, weight, A_log, dt_bias, parents, window[..., :2], 2, 16, 6, 8)


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter replaces the kernels: nothing to compile")
def test_kernel_compiles_for_hopper_at_27b_shapes() -> None:
    """Triton's sm_90 compiler and ptxas accept the kernel with the 27B constants (the reshape of a channel
    block into dk groups included); no GPU needed."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(proj="*bf16", weight="*bf16", nearest="*i32", window="*bf16", a_log="*fp32", dt_bias="*fp32",
                     y="*bf16", keep="*bf16", beta="*fp32", g="*fp32", N="i32", sp_b="i32", sp_n="i32",
                     sw_b="i32", sw_c="i32", swt_c="i32")
    constants = dict(C=10240, QK=4096, VD=6144, HV=48, DK=128, BC=1024, HVP=64, KEEP=True)
    source = ASTSource(fn=tree_inputs._gdn_tree_inputs_kernel,
                       signature=signature | dict.fromkeys(constants, "constexpr"), constexprs=constants)
    options = {"num_warps": 4, "maxnreg": tree_inputs.MAX_REGISTERS}
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


@pytest.mark.gpu
def test_gpu_matches_twin_27b_shapes() -> None:
    """Qwen3.6-27B's GDN layer: HK 16, HV 48, dk = dv = 128 (conv_dim 10240), a 65-node tree, bf16."""
    check("cuda", torch.bfloat16, 1e-2, B=1, N=65, hk=16, dk=128, hv=48, dv=128, shape="best_first")
