"""The one-launch front of the chunk tree solve (verify inputs + Gram tiles + path decays) against its twin,
and the solve that takes its tiles against the solve that makes its own and against the sequential oracle.

Twin: ``gdn_tree_inputs_reference`` (checked against the unfused layer ops in test_gdn_tree_inputs.py) and
``tree_gram_reference``. Triton kernels: see test_tree_common for how they run on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.kernels import TRITON_INTERPRETED, gdn_tree_commit, gdn_tree_verify
from dflash_tfm.kernels.gdn import tree_front
from dflash_tfm.kernels.gdn.tree_front import gdn_tree_front
from dflash_tfm.kernels.gdn.tree_inputs import gdn_tree_inputs_reference
from dflash_tfm.kernels.gdn.tree_reference import (
    GramTiles,
    gdn_path_recurrence,
    gdn_tree_commit_reference,
    gdn_tree_verify_reference,
    tree_gram_reference,
)
from dflash_tfm.spec.tree import ancestor_bitsets

from .test_gdn_tree_inputs import NAMES, make_case
from .test_tree_common import accepted_mask, rel_err, triton_device  # noqa: F401  (fixture)


def lower_block_tiles(t: torch.Tensor, block: int) -> torch.Tensor:
    """The tiles on and below the block diagonal of ``[..., NP, NP]`` (the only ones the kernel writes)."""
    nb = t.shape[-1] // block
    keep = torch.tril(torch.ones(nb, nb, dtype=torch.bool)).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return t[..., keep.to(t.device)]


def run_front(device: str, dtype: torch.dtype, B: int, N: int, hk: int, dk: int, hv: int, dv: int,
              shape: str = "random", block_size: int = 16, pad: int = 3):
    proj, weight, window, A_log, dt_bias, parents = make_case(B, N, hk, dk, hv, dv, device, dtype, pad, shape)
    C = 2 * hk * dk + hv * dv
    kept = torch.full((B, N, C), float("nan"), dtype=dtype, device=device)
    G_out = torch.full((B, N, hv), float("nan"), device=device)
    bits = ancestor_bitsets(parents)
    window_before = window.clone()
    got = gdn_tree_front(proj, weight, A_log, dt_bias, parents, window, bits, hk, dk, hv, dv,
                         block_size=block_size, keep_input=kept, G_out=G_out)
    assert torch.equal(window, window_before) and torch.equal(kept, proj[..., :C])
    assert got[-1].G is G_out
    return proj, weight, window, A_log, dt_bias, parents, bits, got


def check_front(device: str, dtype: torch.dtype, tol: float, B: int, N: int, hk: int, dk: int, hv: int, dv: int,
                shape: str = "random", block_size: int = 16) -> None:
    """Inputs as the twin makes them; tiles and G as the Gram twin makes them from the front's own q, k, g."""
    proj, weight, window, A_log, dt_bias, parents, bits, got = run_front(device, dtype, B, N, hk, dk, hv, dv,
                                                                         shape, block_size)
    want = gdn_tree_inputs_reference(proj, weight, A_log, dt_bias, parents, window, hk, dk, hv, dv)
    for name, a, b in zip(NAMES, got[:6], want):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))
    q, k, g, gram = got[0], got[1], got[5], got[6]
    ref = tree_gram_reference(q, k, g, bits, dk**-0.5, block_size)
    for name in ("kk", "qk"):
        a, b = (lower_block_tiles(getattr(t, name), block_size) for t in (gram, ref))
        assert rel_err(a, b) <= max(tol, 1e-5), (name, rel_err(a, b))
    assert rel_err(gram.G, ref.G) <= 1e-5


@pytest.mark.parametrize("shape", ["chain", "random", "best_first"])
def test_triton_front_matches_twin_fp32(triton_device: str, shape: str) -> None:
    """Grouped values (HV = 3·HK), three row blocks, rows of a wider buffer."""
    check_front(triton_device, torch.float32, 1e-5, B=2, N=40, hk=2, dk=16, hv=6, dv=8, shape=shape)


def test_triton_front_single_node_and_32_row_blocks(triton_device: str) -> None:
    check_front(triton_device, torch.float32, 1e-5, B=1, N=1, hk=2, dk=16, hv=6, dv=8)
    check_front(triton_device, torch.float32, 1e-5, B=1, N=37, hk=1, dk=32, hv=2, dv=16, block_size=32)


def test_triton_front_bf16_rounds_like_the_unfused_path(triton_device: str) -> None:
    check_front(triton_device, torch.bfloat16, 1e-2, B=1, N=21, hk=2, dk=32, hv=6, dv=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_solve_with_front_tiles_matches_its_own_gram_and_the_oracle(triton_device: str,
                                                                           dtype: torch.dtype) -> None:
    """gdn_tree_verify(gram=front's tiles) equals gdn_tree_verify making its own tiles from the same q, k, g
    (outputs, solved rows, path decays, commit), and every node's output is sequential decoding of its path."""
    B, N, hk, dk, hv, dv = 2, 33, 2, 16, 6, 16
    _, _, _, _, _, parents, bits, (q, k, v, z, beta, g, gram) = run_front(triton_device, dtype, B, N, hk, dk,
                                                                           hv, dv, "best_first")
    S0 = 0.3 * torch.randn(B, hv, dk, dv, generator=torch.Generator().manual_seed(5)).to(triton_device)
    u_out = torch.empty(B, N, hv, dv, device=triton_device)
    o, ctx = gdn_tree_verify(q, k, v, g, beta, parents, S0, ancestors=bits, gram=gram, u_out=u_out, G_out=gram.G)
    o_own, ctx_own = gdn_tree_verify(q, k, v, g, beta, parents, S0, ancestors=bits)
    assert ctx.u is u_out and ctx.G is gram.G
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert rel_err(o, o_own) <= tol and rel_err(ctx.u, ctx_own.u) <= tol and rel_err(ctx.G, ctx_own.G) <= 1e-6
    acc = accepted_mask(parents.cpu(), [N - 1, N // 2]).to(triton_device)
    assert rel_err(gdn_tree_commit(ctx, acc), gdn_tree_commit(ctx_own, acc)) <= tol
    if dtype == torch.float32:
        o_seq, _ = gdn_path_recurrence(q, k, v, g, beta, parents, S0)
        assert rel_err(o, o_seq) <= 1e-4


def test_twin_path_and_errors() -> None:
    """On the CPU without the interpreter the twin runs (and fills G_out); bad shapes and misuse are refused."""
    B, N, hk, dk, hv, dv = 1, 9, 2, 16, 6, 8
    proj, weight, window, A_log, dt_bias, parents = make_case(B, N, hk, dk, hv, dv, "cpu", torch.float32)
    args = (proj, weight, A_log, dt_bias, parents, window, None, hk, dk, hv, dv)
    if not TRITON_INTERPRETED:
        G_out = torch.zeros(B, N, hv)
        q, k, v, z, beta, g, gram = gdn_tree_front(*args, G_out=G_out)
        assert gram.G is G_out and rel_err(G_out, tree_gram_reference(q, k, g, ancestor_bitsets(parents), 0.25,
                                                                      16).G) == 0
        S0 = torch.randn(B, hv, dk, dv)
        o, _ = gdn_tree_verify(q, k, v, g, beta, parents, S0, gram=gram)
        assert rel_err(o, gdn_tree_verify_reference(q, k, v, g, beta, parents, S0)[0]) == 0
    with pytest.raises(ValueError, match="G_out must be"):
        gdn_tree_front(*args, G_out=torch.zeros(B, N, hv + 1))
    with pytest.raises(ValueError, match="block_size"):
        gdn_tree_front(*args, block_size=8)
    with pytest.raises(ValueError, match="proj must be"):
        gdn_tree_front(proj[..., 1:], *args[1:])
    q, k, v, z, beta, g = gdn_tree_inputs_reference(*args[:6], hk, dk, hv, dv)
    S0 = torch.randn(B, hv, dk, dv)
    gram = tree_gram_reference(q, k, g, ancestor_bitsets(parents), 0.25, 16)
    with pytest.raises(ValueError, match="gram tiles must be"):
        gdn_tree_verify(q, k, v, g, beta, parents, S0, gram=GramTiles(gram.kk[..., :8, :8], gram.qk, gram.G))
    with pytest.raises(ValueError, match="recurrent"):
        gdn_tree_verify(q, k, v, g, beta, parents, S0, kernel="recurrent", gram=gram)
    with pytest.raises(ValueError, match="G_out must be gram.G"):
        gdn_tree_verify(q, k, v, g, beta, parents, S0, gram=gram, u_out=torch.empty(B, N, hv, dv),
                        G_out=torch.empty(B, N, hv))


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter replaces the kernels: nothing to compile")
@pytest.mark.parametrize("native", [True, False])
def test_kernel_compiles_for_hopper_at_27b_shapes(native: bool) -> None:
    """Triton's sm_90 compiler and ptxas accept the kernel with the Qwen3.6-27B constants (bf16 Gram dots on
    tensor cores, or tf32); no GPU needed."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = ("proj", "weight", "nearest", "window", "a_log", "dt_bias", "bits", "y", "keep", "beta", "g", "kk",
                "qk", "G")
    types = ("*bf16", "*bf16", "*i32", "*bf16", "*fp32", "*fp32", "*i64", "*bf16", "*bf16", "*fp32", "*fp32",
             "*fp32", "*fp32", "*fp32")
    scalars = dict(N="i32", W="i32", NB="i32", HK="i32", R="i32", NP="i32", GRAM_PROGRAMS="i32", scale="fp32",
                   sp_b="i32", sp_n="i32", sw_b="i32", sw_c="i32", swt_c="i32")
    constants = dict(C=10240, QK=4096, VD=6144, HV=48, DK=128, BC=2048, HVP=64, RP=16, BT=16, KEEP=True,
                     PREC="tf32", NATIVE=native)
    source = ASTSource(fn=tree_front._gdn_tree_front_kernel,
                       signature=dict(zip(pointers, types)) | scalars | dict.fromkeys(constants, "constexpr"),
                       constexprs=constants)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["cubin"]


@pytest.mark.gpu
@pytest.mark.parametrize("N", [16, 65, 129])
def test_gpu_front_and_solve_match_twin_27b_shapes(N: int) -> None:
    """Qwen3.6-27B's GDN layer (HK 16, HV 48, dk = dv = 128), best-first trees, bf16: the front's inputs and
    tiles against the twin, and the solve on its tiles against the solve on its own."""
    check_front("cuda", torch.bfloat16, 1e-2, B=1, N=N, hk=16, dk=128, hv=48, dv=128, shape="best_first")
    _, _, _, _, _, parents, bits, (q, k, v, z, beta, g, gram) = run_front("cuda", torch.bfloat16, 1, N, 16, 128,
                                                                           48, 128, "best_first")
    S0 = 0.1 * torch.randn(1, 48, 128, 128, device="cuda")
    o, ctx = gdn_tree_verify(q, k, v, g, beta, parents, S0, ancestors=bits, gram=gram)
    o_own, ctx_own = gdn_tree_verify(q, k, v, g, beta, parents, S0, ancestors=bits)
    assert rel_err(o, o_own) <= 1e-3 and rel_err(ctx.u, ctx_own.u) <= 1e-3
    o_ref, ctx_ref = gdn_tree_verify_reference(q, k, v, g, beta, parents, S0)
    assert rel_err(o, o_ref) <= 1e-2
    acc = accepted_mask(parents.cpu(), [N - 1]).cuda()
    assert rel_err(gdn_tree_commit(ctx, acc), gdn_tree_commit_reference(ctx_ref, acc)) <= 5e-3
