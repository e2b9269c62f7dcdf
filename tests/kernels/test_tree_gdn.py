"""GDN tree verify/commit: every node equals sequential decoding of its root→node path.

Oracle: ``gdn_path_recurrence`` (float64 recurrence along every root→leaf path). Second oracle on a chain:
transformers' ``torch_chunk_gated_delta_rule``. The torch twin is checked up to 129 nodes; the Triton
kernels (interpreter on the CPU, see test_tree_common) at small sizes; GPU tests compare Triton and twin
at Qwen3.6-27B shapes.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from dflash_tfm.kernels import TRITON_INTERPRETED, gdn_tree_commit, gdn_tree_verify
from dflash_tfm.kernels.gdn.tree_reference import (
    gdn_path_recurrence,
    gdn_tree_commit_reference,
    gdn_tree_verify_reference,
)
from dflash_tfm.tree import TREE_SHAPES, ancestor_bitsets, random_parents

from dflash_tfm.kernels.gdn import tree_commit
from dflash_tfm.kernels.gdn.tree_verify import TF32_SOLVE_MIN_NODES, ChunkSolve

from .test_tree_common import accepted_mask, rel_err, triton_device  # noqa: F401  (fixture)

TOL = 1e-4


def make_inputs(B: int, N: int, HK: int, r: int, dk: int, dv: int, seed: int = 0, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Unit q/k, β ∈ (0, 1), g ≤ 0 (model-like: e^g mostly 0.7–1), a non-zero fp32 initial state."""
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q": F.normalize(torch.randn(B, N, HK, dk, generator=gen), dim=-1),
        "k": F.normalize(torch.randn(B, N, HK, dk, generator=gen), dim=-1),
        "v": torch.randn(B, N, HK * r, dv, generator=gen),
        "g": F.logsigmoid(torch.randn(B, N, HK * r, generator=gen) + 2.0),
        "beta": torch.rand(B, N, HK * r, generator=gen).clamp(0.01, 0.99),
        "initial_state": 0.5 * torch.randn(B, HK * r, dk, dv, generator=gen),
    }
    low = ("q", "k", "v")
    return {n: t.to(device=device, dtype=dtype if n in low else torch.float32) for n, t in x.items()}


def trees(B: int, N: int, shape: str, seed: int = 0) -> torch.Tensor:
    return torch.stack([random_parents(N, shape, seed=seed + b) for b in range(B)])


def check_against_oracle(x: dict, parents: torch.Tensor, kernel: str | None, tol: float = TOL, **kw) -> None:
    """Outputs of all nodes, commit after a path to a random node (and to nothing), S0 untouched; ``kw``: the chunk
    kernel's `ChunkSolve` settings."""
    S0 = x["initial_state"].clone()
    if kernel is None:
        o, ctx = gdn_tree_verify_reference(**x, parents=parents)
        commit = gdn_tree_commit_reference
    else:
        o, ctx = gdn_tree_verify(**x, parents=parents.to(x["q"].device), kernel=kernel, solve=ChunkSolve(**kw))
        commit = gdn_tree_commit
    o_ref, states = gdn_path_recurrence(**x, parents=parents)
    assert o.shape == o_ref.shape and o.dtype == x["v"].dtype
    assert rel_err(o, o_ref) <= tol
    B, N = parents.shape
    nodes = torch.randint(0, N, (B,), generator=torch.Generator().manual_seed(N)).tolist()
    acc = accepted_mask(parents, nodes).to(o.device)
    S = commit(ctx, acc)
    assert rel_err(S, states[torch.arange(B), nodes]) <= tol
    assert rel_err(commit(ctx, torch.zeros_like(acc)), S0) == 0.0
    assert torch.equal(x["initial_state"], S0)


# ---- torch twin -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("N", [1, 2, 17, 65, 129])
def test_reference_matches_path_recurrence(shape: str, N: int) -> None:
    check_against_oracle(make_inputs(2, N, 2, 3, 16, 16, seed=N), trees(2, N, shape), kernel=None)


def test_reference_with_given_bitsets_and_scale() -> None:
    x = make_inputs(1, 30, 1, 3, 16, 32)
    parents = trees(1, 30, "best_first")
    o, _ = gdn_tree_verify_reference(**x, parents=parents, scale=0.3, ancestors=ancestor_bitsets(parents))
    assert rel_err(o, gdn_path_recurrence(**x, parents=parents, scale=0.3)[0]) <= TOL


def hf_chunk_gated_delta_rule():
    """transformers' torch implementation (unwrapped: the decorator may swap in fla's Triton kernel)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)


def check_chain_against_hf(x: dict, o: torch.Tensor, state: torch.Tensor) -> None:
    """HF repeats q/k per value head itself in the model; it scales q by dk^-0.5 and (unasked) no l2norm."""
    r = x["v"].shape[2] // x["q"].shape[2]
    o_hf, s_hf = hf_chunk_gated_delta_rule()(
        x["q"].cpu().repeat_interleave(r, 2), x["k"].cpu().repeat_interleave(r, 2), x["v"].cpu(), g=x["g"].cpu(),
        beta=x["beta"].cpu(), chunk_size=64, initial_state=x["initial_state"].cpu(), output_final_state=True,
        use_qk_l2norm_in_kernel=False)
    assert rel_err(o, o_hf) <= TOL
    assert rel_err(state, s_hf) <= TOL


def test_reference_chain_matches_hf_chunk_rule() -> None:
    x = make_inputs(1, 129, 2, 3, 16, 16, seed=3)
    parents = trees(1, 129, "chain")
    o, ctx = gdn_tree_verify_reference(**x, parents=parents)
    check_chain_against_hf(x, o, gdn_tree_commit_reference(ctx, torch.ones(1, 129, dtype=torch.bool)))


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the CPU runs Triton's interpreter in this process")
@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_cpu_tensors_run_the_twin(kernel: str) -> None:
    x = make_inputs(1, 9, 1, 3, 16, 16)
    parents = trees(1, 9, "binary")
    o, ctx = gdn_tree_verify(**x, parents=parents, kernel=kernel)
    o_ref, ctx_ref = gdn_tree_verify_reference(**x, parents=parents)
    assert torch.equal(o, o_ref) and torch.equal(ctx.u, ctx_ref.u)
    acc = accepted_mask(parents, [8])
    assert torch.equal(gdn_tree_commit(ctx, acc), gdn_tree_commit_reference(ctx_ref, acc))


def test_input_validation() -> None:
    x = make_inputs(1, 8, 2, 3, 16, 16)
    parents = trees(1, 8, "random")
    with pytest.raises(ValueError, match="parents"):
        gdn_tree_verify(**x, parents=parents[:, :5])
    with pytest.raises(ValueError, match="v must be"):
        gdn_tree_verify(**{**x, "v": x["v"][:, :, :5]}, parents=parents)
    with pytest.raises(ValueError, match="initial_state"):
        gdn_tree_verify(**{**x, "initial_state": x["initial_state"][:, :, :8]}, parents=parents)
    with pytest.raises(ValueError, match="g and beta"):
        gdn_tree_verify(**{**x, "g": x["g"][..., :2]}, parents=parents)
    with pytest.raises(ValueError, match="kernel"):
        gdn_tree_verify(**x, parents=parents, kernel="fused")
    for bad, match in (({"block_size": 8}, "block_size"), ({"precision": "bf16"}, "precision"),
                       ({"block_v": 8}, "block_v"), ({"state_block_v": 8}, "state_block_v"),
                       ({"block_size": 32, "solve_width": 16}, "solve_width")):
        with pytest.raises(ValueError, match=match):
            gdn_tree_verify(**x, parents=parents, solve=ChunkSolve(**bad))


# ---- Triton (interpreter on the CPU, compiled on a GPU) --------------------------------------------

@pytest.mark.parametrize("shape", TREE_SHAPES)
def test_triton_chunk_matches_path_recurrence(shape: str, triton_device: str) -> None:
    x = make_inputs(1, 37, 1, 3, 16, 16, seed=7, device=triton_device)
    check_against_oracle(x, trees(1, 37, shape, seed=5), kernel="chunk")


@pytest.mark.parametrize("N, block_size", [(1, 16), (16, 16), (21, 32), (40, 32), (70, 16)])
def test_triton_chunk_block_edges_batch_and_dims(N: int, block_size: int, triton_device: str) -> None:
    """N at and around block boundaries and past 64 (two bitset words), two different trees in a batch,
    dv ≠ dk with two dv blocks."""
    parents = torch.stack([random_parents(N, "best_first", seed=1), random_parents(N, "random", seed=2)])
    x = make_inputs(2, N, 1, 3, 16, 48, seed=N, device=triton_device)
    check_against_oracle(x, parents, kernel="chunk", block_size=block_size)


# `ChunkSolve` settings of the chunk kernel. Under the interpreter "tf32"/"tf32x3" run as fp32; on a GPU "tf32"
# rounds the inputs to 10 mantissa bits.
CHUNK_OPTIONS = [
    (33, {}),
    (70, {"state_block_v": 16}),  # 3 dv programs per row
    (70, {"solve_width": 64, "num_stages": 1, "precision": "tf32x3"}),
    (21, {"block_size": 32, "state_block_v": 32, "block_v": 64, "num_warps": 2}),
    (40, {"block_size": 32, "solve_width": 64, "block_v": 16, "precision": "tf32", "solve_precision": "tf32x3"}),
    (1, {"solve_width": 32}),
    (70, {"state_block_v": 32, "block_v": 32}),
    (40, {"precision": "tf32x3", "block_v": 16}),
    (40, {"block_size": 32, "block_v": 64, "num_warps": 4, "num_stages": 1, "solve_precision": "tf32x3"}),
    (70, {"gram_native": True}),  # fp32 inputs here: the flag must leave them at fp32
]


@pytest.mark.parametrize("N, options", CHUNK_OPTIONS, ids=[f"{n}-{'-'.join(map(str, o.values())) or 'default'}"
                                                            for n, o in CHUNK_OPTIONS])
def test_triton_chunk_options_match_path_recurrence(N: int, options: dict, triton_device: str) -> None:
    """Every precision / blocking setting: two trees in a batch, dv ≠ dk with partial dv blocks."""
    parents = torch.stack([random_parents(N, "best_first", seed=1), random_parents(N, "random", seed=2)])
    x = make_inputs(2, N, 1, 3, 16, 48, seed=N, device=triton_device)
    tf32 = triton_device == "cuda" and "tf32" in (options.get("precision"), options.get("solve_precision"))
    check_against_oracle(x, parents, kernel="chunk", tol=1e-2 if tf32 else TOL, **options)


def test_triton_chunk_chain_matches_hf_chunk_rule(triton_device: str) -> None:
    x = make_inputs(1, 40, 1, 3, 32, 16, seed=11, device=triton_device)
    parents = trees(1, 40, "chain").to(triton_device)
    o, ctx = gdn_tree_verify(**x, parents=parents, ancestors=ancestor_bitsets(parents))
    check_chain_against_hf(x, o, gdn_tree_commit(ctx, torch.ones(1, 40, dtype=torch.bool, device=triton_device)))


@pytest.mark.parametrize("shape", ["best_first", "random"])
def test_triton_recurrent_matches_path_recurrence(shape: str, triton_device: str) -> None:
    x = make_inputs(1, 24, 1, 3, 16, 16, seed=13, device=triton_device)
    check_against_oracle(x, trees(1, 24, shape, seed=3), kernel="recurrent")


def test_triton_bf16_inputs_match_twin(triton_device: str) -> None:
    """bf16 q/k/v (as in the model): Triton and the twin read the same values, so they agree to bf16 output rounding."""
    x = make_inputs(1, 20, 1, 3, 16, 16, seed=17, device=triton_device, dtype=torch.bfloat16)
    parents = trees(1, 20, "best_first").to(triton_device)
    o, ctx = gdn_tree_verify(**x, parents=parents)
    o_ref, ctx_ref = gdn_tree_verify_reference(**x, parents=parents)
    assert o.dtype == torch.bfloat16 and rel_err(o, o_ref) <= 1e-2
    assert rel_err(ctx.u, ctx_ref.u) <= TOL
    acc = torch.ones(1, 20, dtype=torch.bool, device=triton_device)
    acc[0, 10:] = False
    assert rel_err(gdn_tree_commit(ctx, acc), gdn_tree_commit_reference(ctx_ref, acc)) <= TOL


# ---- GPU, Qwen3.6-27B shapes --------------------------------------------------------------------------

def gpu_case(N: int) -> tuple[dict, torch.Tensor]:
    x = make_inputs(1, N, 16, 3, 128, 128, seed=N, device="cuda", dtype=torch.bfloat16)
    return x, trees(1, N, "best_first").cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
@pytest.mark.parametrize("N", [16, 32, 65, 129])
def test_gpu_matches_twin_27b_shapes(N: int, kernel: str) -> None:
    x, parents = gpu_case(N)
    S0 = x["initial_state"].clone()
    o, ctx = gdn_tree_verify(**x, parents=parents, kernel=kernel)
    o_ref, ctx_ref = gdn_tree_verify_reference(**x, parents=parents)
    assert rel_err(o, o_ref) <= 1e-2
    acc = accepted_mask(parents.cpu(), [N - 1]).cuda()
    tf32_solve = kernel == "chunk" and N > TF32_SOLVE_MIN_NODES  # the default solve of bf16 inputs there
    assert rel_err(gdn_tree_commit(ctx, acc), gdn_tree_commit_reference(ctx_ref, acc)) <= (5e-3 if tf32_solve else 1e-3)
    assert torch.equal(x["initial_state"], S0)


GPU_OPTIONS = [
    {"precision": "tf32x3", "solve_width": 64},
    {"precision": "tf32", "solve_precision": "tf32x3", "num_warps": 2},
    {"precision": "tf32x3", "block_size": 32, "num_stages": 1},
    {"precision": "tf32x3", "block_v": 16},
    {"gram_native": False},
]


@pytest.mark.gpu
@pytest.mark.parametrize("options", GPU_OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
@pytest.mark.parametrize("N", [16, 65, 129])
def test_gpu_options_match_twin_27b_shapes(N: int, options: dict) -> None:
    """The `ChunkSolve` settings at Qwen3.6-27B shapes, within the bf16-input tolerance of the default path."""
    x, parents = gpu_case(N)
    o, ctx = gdn_tree_verify(**x, parents=parents, solve=ChunkSolve(**options))
    o_ref, ctx_ref = gdn_tree_verify_reference(**x, parents=parents)
    assert rel_err(o, o_ref) <= 1e-2
    acc = accepted_mask(parents.cpu(), [N - 1]).cuda()
    tf32_solve = options.get("solve_precision", "tf32" if N > TF32_SOLVE_MIN_NODES else "ieee") == "tf32"
    tol = 1e-2 if options.get("precision") == "tf32" or tf32_solve else 1e-3
    assert rel_err(gdn_tree_commit(ctx, acc), gdn_tree_commit_reference(ctx_ref, acc)) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"precision": "tf32x3"}], ids=["default", "tf32x3"])
def test_gpu_cuda_graph_replay(options: dict) -> None:
    """Verify + commit are capturable (no host sync) and replay to the same result."""
    x, parents = gpu_case(65)
    bits = ancestor_bitsets(parents)
    acc = accepted_mask(parents.cpu(), [64]).cuda()
    o_eager, ctx = gdn_tree_verify(**x, parents=parents, ancestors=bits, solve=ChunkSolve(**options))
    S_eager = gdn_tree_commit(ctx, acc)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ctx = gdn_tree_verify(**x, parents=parents, ancestors=bits, solve=ChunkSolve(**options))
        S = gdn_tree_commit(ctx, acc)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, o_eager) and torch.equal(S, S_eager)


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_triton_commit_in_place_equals_a_new_state(kernel: str, triton_device: str) -> None:
    """out = the initial state itself (what the model's commit does): the same state as a fresh output."""
    x = make_inputs(1, 20, 1, 3, 16, 16, seed=5, device=triton_device)
    parents = trees(1, 20, "best_first").to(triton_device)
    _, ctx = gdn_tree_verify(**x, parents=parents, kernel=kernel)
    acc = accepted_mask(parents.cpu(), [19]).to(triton_device)
    expect = gdn_tree_commit(ctx, acc)
    state = ctx.initial_state
    assert gdn_tree_commit(ctx, acc, out=state) is state
    assert torch.equal(state, expect)


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_commit_of_a_row_that_accepted_nothing_keeps_its_state(kernel: str, triton_device: str) -> None:
    """A batch row still in its prompt commits nothing, not even its root: its state comes back unchanged while
    the other row folds its path (the twin's rule, `gdn_tree_commit_reference`)."""
    parents = trees(2, 20, "best_first").to(triton_device)
    x = make_inputs(2, 20, 1, 3, 16, 16, seed=7, device=triton_device)
    _, ctx = gdn_tree_verify(**x, parents=parents, kernel=kernel)
    acc = accepted_mask(parents.cpu(), [19, 0]).to(triton_device)
    acc[1] = False
    state = gdn_tree_commit(ctx, acc)
    assert torch.equal(state[1], ctx.initial_state[1].float())
    assert not torch.equal(state[0], ctx.initial_state[0].float())
    assert rel_err(state, gdn_tree_commit_reference(ctx, acc)) <= 1e-5


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_commit_with_fewer_paths_than_rows_repeats_them(kernel: str, triton_device: str) -> None:
    """accepted with P rows for a batch of 2P (two layers stacked along the batch, as the model's commit does):
    row b folds path b % P, the same states as repeating the paths."""
    parents = torch.stack([random_parents(40, "best_first", seed=1), random_parents(40, "random", seed=2)] * 2)
    x = make_inputs(4, 40, 1, 3, 16, 16, seed=23, device=triton_device)
    _, ctx = gdn_tree_verify(**x, parents=parents.to(triton_device), kernel=kernel)
    paths = accepted_mask(parents[:2], [39, 27]).to(triton_device)
    assert torch.equal(gdn_tree_commit(ctx, paths), gdn_tree_commit(ctx, paths.repeat(2, 1)))
    with pytest.raises(ValueError, match="multiple of P"):
        gdn_tree_commit(ctx, paths[:, None])


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter replaces the kernels: nothing to compile")
def test_fold_kernel_compiles_for_hopper() -> None:
    """The fold's loop runs to a bound it loads (the path length): Triton's sm_90 compiler and ptxas accept it
    (no GPU needed; the interpreter tests check the numbers)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dflash_tfm.kernels.gdn.tree_commit import _gdn_tree_fold_kernel

    f32 = "*fp32"
    signature = dict(k="*bf16", u=f32, G=f32, accepted="*u8", S0=f32, out=f32, N="i32", HK="i32", R="i32",
                     PATHS="i32", sk_b="i32", sk_n="i32", sk_h="i32", ss_b="i32", ss_h="i32", ss_k="i32")
    constants = dict(DK=128, DV=128, BK=128, BV=tree_commit.FOLD_BLOCK_V, BP=16, NPOW=128)
    source = ASTSource(fn=_gdn_tree_fold_kernel, signature=signature | dict.fromkeys(constants, "constexpr"),
                       constexprs=constants)
    options = {"num_warps": tree_commit.FOLD_WARPS}
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def test_triton_fold_matches_twin_over_partial_blocks(triton_device: str) -> None:
    """dv = 48 (a partial dv block) and a path longer than one gather."""
    x = make_inputs(2, 40, 1, 3, 16, 48, seed=31, device=triton_device)
    parents = torch.stack([random_parents(40, "chain", seed=1), random_parents(40, "random", seed=2)])
    _, ctx = gdn_tree_verify(**x, parents=parents.to(triton_device))
    acc = accepted_mask(parents, [39, 33]).to(triton_device)
    assert rel_err(gdn_tree_commit(ctx, acc), gdn_tree_commit_reference(ctx, acc)) <= TOL


@pytest.mark.gpu
def test_gpu_fold_matches_twin_27b_shapes() -> None:
    x, parents = gpu_case(65)
    _, ctx = gdn_tree_verify(**x, parents=parents)
    acc = accepted_mask(parents.cpu(), [64]).cuda()
    assert rel_err(gdn_tree_commit(ctx, acc), gdn_tree_commit_reference(ctx, acc)) <= 1e-4


def test_verify_writes_the_context_into_given_buffers(triton_device: str) -> None:
    """u_out / G_out (slices of a layer-stacked buffer, as the model passes) receive exactly the context the
    verify would otherwise allocate; the recurrent kernel refuses them."""
    x = make_inputs(1, 37, 1, 3, 16, 16, seed=29, device=triton_device)
    parents = trees(1, 37, "best_first").to(triton_device)
    o, ctx = gdn_tree_verify(**x, parents=parents)
    u_stack = torch.full((2, 1, 37, 3, 16), float("nan"), device=triton_device)
    G_stack = torch.full((2, 1, 37, 3), float("nan"), device=triton_device)
    o_out, ctx_out = gdn_tree_verify(**x, parents=parents, u_out=u_stack[1], G_out=G_stack[1])
    assert ctx_out.u.data_ptr() == u_stack[1].data_ptr() and ctx_out.G.data_ptr() == G_stack[1].data_ptr()
    assert torch.equal(o_out, o) and torch.equal(u_stack[1], ctx.u) and torch.equal(G_stack[1], ctx.G)
    with pytest.raises(ValueError, match="u_out must be"):
        gdn_tree_verify(**x, parents=parents, u_out=u_stack[1, :, :5], G_out=G_stack[1])
    with pytest.raises(ValueError, match="together"):
        gdn_tree_verify(**x, parents=parents, kernel="recurrent", u_out=u_stack[1], G_out=G_stack[1])
