"""The MoE kernels (`kernels/moe/`) against their twins: the expert row blocks against a sort, the grouped expert
GEMMs against the PyTorch experts of `reference.py` (Triton's interpreter on the CPU at small sizes, Qwen3.5-35B-A3B
sizes on the GPU), and the MoE block captured in a CUDA graph against its eager run."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from dflash_tfm.kernels import TRITON_INTERPRETED
from dflash_tfm.kernels.moe import expert_blocks as blocks_module
from dflash_tfm.kernels.moe import grouped_experts as grouped_module
from dflash_tfm.kernels.moe.expert_blocks import expert_blocks, expert_blocks_reference, max_blocks
from dflash_tfm.kernels.moe.grouped_experts import ExpertTiles, routed_experts
from dflash_tfm.kernels.moe.reference import routed_experts_reference
from dflash_tfm.layers.moe import SparseMoE, route

from .test_tree_common import rel_err, triton_device  # noqa: F401  (fixture)


def random_experts(tokens: int, k: int, num_experts: int, seed: int, used: int | None = None) -> torch.Tensor:
    """[T, k] distinct experts per token, drawn from the first `used` experts (all by default)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(used or num_experts, generator=gen)[:k] for _ in range(tokens)])


def skewed_experts(tokens: int, k: int) -> torch.Tensor:
    """Every token picks experts 0 … k − 1: k experts with T rows each, the rest none."""
    return torch.arange(k).repeat(tokens, 1)


def expert_weights(E: int, H: int, I: int, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    down = torch.randn(E, H, I, generator=gen) / I ** 0.5
    return gate_up.to(device=device, dtype=dtype), down.to(device=device, dtype=dtype)


def check_blocks(experts: torch.Tensor, num_experts: int, block_m: int) -> None:
    """The definition of the row blocks: `order` is a stable sort by expert; the used blocks come first, each
    holds 1 … block_m rows of its own expert, and together they hold every row once, in order."""
    order, block_expert, block_rows = (t.cpu() for t in expert_blocks_reference(experts, num_experts, block_m))
    ids = experts.flatten()
    assert torch.equal(order.long(), ids.argsort(stable=True))
    used = block_expert >= 0
    assert block_expert.shape == (max_blocks(ids.numel(), num_experts, block_m),)
    counts = torch.bincount(ids, minlength=num_experts)
    assert used.sum() == (counts + block_m - 1).div(block_m, rounding_mode="floor").sum()
    assert torch.equal(used, torch.arange(used.numel()) < used.sum())
    rows = [torch.arange(int(a), int(b)) for a, b in block_rows[used]]
    assert all(0 < r.numel() <= block_m for r in rows)
    assert torch.equal(torch.cat(rows), torch.arange(ids.numel()))
    for e, r in zip(block_expert[used].tolist(), rows):
        assert (ids[order[r]] == e).all()
    assert (block_rows[~used] == 0).all()


@pytest.mark.parametrize("tokens, k, E, block_m", [(1, 8, 16, 16), (5, 2, 8, 16), (37, 2, 8, 16), (100, 4, 6, 16),
                                                   (9, 3, 40, 32)])
def test_reference_blocks_follow_the_definition(tokens: int, k: int, E: int, block_m: int) -> None:
    check_blocks(random_experts(tokens, k, E, seed=tokens), E, block_m)
    check_blocks(skewed_experts(tokens, k), E, block_m)


def test_max_blocks_is_reached_when_every_active_expert_wastes_most_of_a_block() -> None:
    """E active experts with 1 + 16 j rows each need all the blocks the bound allows."""
    E, block_m = 4, 16
    ids = torch.cat([torch.full((1 + 16 * e,), e) for e in range(E)])
    blocks = expert_blocks_reference(ids.view(-1, 1), E, block_m)
    assert int((blocks.block_expert >= 0).sum()) == max_blocks(ids.numel(), E, block_m) == 1 + 2 + 3 + 4


BLOCK_CASES = {  # name: (experts [T, k], E, block_m, chunk)
    "decode_T1_k8": (random_experts(1, 8, 10, seed=1), 10, 16, 16),
    "T3_k2_unused_experts": (random_experts(3, 2, 12, seed=2, used=5), 12, 16, 16),
    "T40_k2_several_programs": (random_experts(40, 2, 8, seed=3), 8, 16, 16),
    "T40_k2_E40_blocks_over_programs": (random_experts(40, 2, 40, seed=5), 40, 16, 16),  # 42 blocks, 16 a program
    "T64_k1_skewed_block32": (skewed_experts(64, 1), 5, 32, 32),
    "T20_k4_E300": (random_experts(20, 4, 300, seed=4), 300, 16, 64),
}


@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_triton_expert_blocks_match_reference(name: str, triton_device: str) -> None:
    experts, E, block_m, chunk = BLOCK_CASES[name]
    got = expert_blocks(experts.to(triton_device), E, block_m, chunk=chunk)
    want = expert_blocks_reference(experts, E, block_m)
    for field, a, b in zip(want._fields, got, want):
        assert a.dtype == torch.int32 and torch.equal(a.cpu(), b), field


TILES = ExpertTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
EXPERT_CASES = {  # name: (experts [T, k], E, H, I, tiles); H and I off the 16-wide tiles
    "T1_k1": (random_experts(1, 1, 4, seed=5), 4, 40, 24, TILES),
    "T1_k8": (random_experts(1, 8, 10, seed=6), 10, 40, 24, TILES),
    "T3_k2_unused_experts": (random_experts(3, 2, 8, seed=7, used=4), 8, 40, 24, TILES),
    "T40_k2_many_rows_per_expert": (random_experts(40, 2, 4, seed=8), 4, 40, 24, TILES),
    "T24_k2_skewed_block32": (skewed_experts(24, 2), 6, 36, 20, ExpertTiles(32, 16, 32, 4, 1)),
    "T5_k8_default_tiles": (random_experts(5, 8, 12, seed=9), 12, 72, 40, None),
}


# fp16 checks that every intermediate is rounded where the twin rounds it (the interpreter's bf16 dots are wrong:
# bf16 is left to the GPU tests)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("name", list(EXPERT_CASES))
def test_triton_routed_experts_match_twin(name: str, dtype: torch.dtype, tol: float, triton_device: str) -> None:
    experts, E, H, I, tiles = EXPERT_CASES[name]
    T, k = experts.shape
    gen = torch.Generator().manual_seed(len(name))
    x = torch.randn(T, H, generator=gen).to(triton_device, dtype)
    weights = torch.rand(T, k, generator=gen).to(triton_device, dtype)
    gate_up, down = expert_weights(E, H, I, dtype, triton_device, seed=T)
    got = routed_experts(x, weights, experts.to(triton_device), gate_up, down, tiles)
    want = routed_experts_reference(x.cpu(), weights.cpu(), experts, gate_up.cpu(), down.cpu())
    assert got.shape == (T, H) and got.dtype == dtype
    assert rel_err(got, want) <= tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("k, E, H, I, held_elsewhere", [(1, 4, 40, 24, False), (8, 10, 72, 40, False),
                                                        (8, 10, 300, 130, False), (4, 8, 40, 24, True)])
def test_one_token_takes_the_decode_kernels_and_matches_twin(k: int, E: int, H: int, I: int, held_elsewhere: bool,
                                                             dtype: torch.dtype, tol: float, triton_device: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step (one token, no tiles given) whose tuned choice is "gemv" runs the two GEMV kernels of
    `decode_experts.py`, not the grouped ones; sizes off their 16 x 128 tiles, and ids of −1 (experts another
    rank holds) add nothing."""
    experts = random_experts(1, k, E, seed=k + E)
    if held_elsewhere:
        experts[0, ::2] = -1
    gen = torch.Generator().manual_seed(H)
    x = torch.randn(1, H, generator=gen).to(dtype)
    weights = torch.rand(1, k, generator=gen).to(dtype)
    gate_up, down = expert_weights(E, H, I, dtype, "cpu", seed=I)
    want = routed_experts_reference(x, weights, experts, gate_up, down)
    monkeypatch.setattr(grouped_module, "expert_blocks", None)  # the grouped path would fail
    with grouped_module.DECODE_EXPERTS.forced("gemv"):
        got = routed_experts(x.to(triton_device), weights.to(triton_device), experts.to(triton_device),
                             gate_up.to(triton_device), down.to(triton_device))
    assert got.shape == (1, H) and got.dtype == dtype
    assert rel_err(got, want) <= tol


def test_assignments_held_elsewhere_add_nothing(triton_device: str) -> None:
    """Expert parallelism: ids of −1 are experts another rank holds. The twin's result is the sum over the
    assignments held here alone (by definition: weights of the others zeroed), and the kernels, asked to expect
    −1 (`elsewhere`), give the twin's; the ranks' partial sums add up to the whole block."""
    T, k, E, H, I = 9, 4, 8, 40, 24
    experts = random_experts(T, k, E, seed=11)
    gen = torch.Generator().manual_seed(3)
    x, weights = torch.randn(T, H, generator=gen), torch.rand(T, k, generator=gen)
    gate_up, down = expert_weights(E, H, I, torch.float32, "cpu", seed=T)
    whole = routed_experts_reference(x, weights, experts, gate_up, down)
    partial = []
    for first in (0, 4):  # two ranks of 4 experts
        local = experts - first
        held = torch.where((local >= 0) & (local < 4), local, -1)
        assert (held == -1).any() and (held >= 0).any()
        want = torch.zeros(T, H)  # the definition, one assignment at a time
        for t, j in zip(*torch.nonzero(held >= 0, as_tuple=True)):
            gate, up = (gate_up[first + held[t, j]] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (down[first + held[t, j]] @ (F.silu(gate) * up))
        assert rel_err(routed_experts_reference(x, weights, held, gate_up[first:first + 4],
                                                down[first:first + 4]), want) <= 1e-5
        got = routed_experts(x.to(triton_device), weights.to(triton_device), held.to(triton_device),
                             gate_up[first:first + 4].to(triton_device), down[first:first + 4].to(triton_device),
                             TILES, elsewhere=True)
        assert rel_err(got, want) <= 1e-5
        partial.append(want)
    assert rel_err(partial[0] + partial[1], whole) <= 1e-5


def test_triton_moe_block_runs_the_kernels(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block hands its normed rows, mixing weights and choices to the Triton experts (the twin is barred)."""
    H, E, k, I, S = 40, 8, 2, 24, 16
    moe = SparseMoE(H, E, k, I, S, normalise_top_k=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    moe = moe.to(triton_device)
    monkeypatch.setattr(grouped_module, "routed_experts_reference", None)
    x = torch.randn(1, 6, H, generator=torch.Generator().manual_seed(0)).to(triton_device)
    with torch.no_grad():
        got = moe(x)
        rows = x.view(-1, H)
        weights, experts = route(F.linear(rows, moe.in_proj[:E]), k, True)
        routed = routed_experts_reference(rows, weights.to(x.dtype), experts, moe.experts_gate_up, moe.experts_down)
        gate, up = F.linear(rows, moe.in_proj[E + 1:]).chunk(2, dim=-1)
        shared = torch.sigmoid(F.linear(rows, moe.in_proj[E:E + 1])) * F.linear(F.silu(gate) * up, moe.shared_down)
    assert rel_err(got.view(-1, H), routed + shared) <= 1e-5


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter replaces the kernels: nothing to compile")
def test_kernels_compile_for_hopper() -> None:
    """All three kernels compile to sm_90 code at 35B-A3B decode and prefill tiles (Triton's compiler and ptxas;
    no GPU needed), with ones in the unit strides as Triton specialises them at launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_(fn, signature: dict, constexprs: dict, num_stages: int = 3) -> None:
        signature = {name: "constexpr" if name in constexprs else kind for name, kind in signature.items()}
        source = ASTSource(fn=fn, signature=signature | dict.fromkeys(constexprs, "constexpr"), constexprs=constexprs)
        options = {"num_warps": 4, "num_stages": num_stages}
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        assert kernel.asm["cubin"]

    compile_(blocks_module._expert_blocks_kernel,
             dict(ids="*i64", order="*i32", block_expert="*i32", block_rows="*i32", A="i32", E="i32", NUM_BLOCKS="i32"),
             dict(BM=16, BE=256, CHUNK=256, HIST=1024, BA=32))
    blocks = dict(order="*i32", block_expert="*i32", block_rows="*i32")
    for t in (grouped_module.default_tiles(8, 256), grouped_module.default_tiles(16384, 256)):
        tiles = dict(PRECISION="tf32", BM=t.block_m, BN=t.block_n, BK=t.block_k)
        compile_(grouped_module._gate_up_kernel,
                 dict(x="*bf16", w="*bf16", hidden="*bf16", **blocks, H="i32", I="i32", TOP_K="i32", sxt="i32",
                      sxh="i32", swe="i32", swn="i32", swh="i32"), dict(sxh=1, swh=1, **tiles), t.num_stages)
        compile_(grouped_module._down_kernel,
                 dict(hidden="*bf16", w="*bf16", mixing="*bf16", out="*bf16", **blocks, H="i32", I="i32", swe="i32",
                      swh="i32", swi="i32"), dict(swi=1, **tiles), t.num_stages)


H35, E35, K35, I35 = 2048, 256, 8, 512  # Qwen3.5-35B-A3B: hidden, experts, top-k, expert width


@pytest.fixture(scope="module")
def moe_35b() -> SparseMoE:
    """One Qwen3.5-35B-A3B MoE block on the GPU, bf16, random weights at the checkpoint's scale."""
    moe = SparseMoE(H35, E35, K35, I35, 512, normalise_top_k=True).to("cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return moe


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 65, 512])
def test_gpu_routed_experts_match_twin_35b_shapes(tokens: int, moe_35b: SparseMoE) -> None:
    """Routed as the block routes them, and all tokens on the same 8 experts (512 rows each at T = 512)."""
    x = torch.randn(tokens, H35, device="cuda", dtype=torch.bfloat16)
    weights, experts = route(x @ moe_35b.in_proj[:E35].T, K35, True)
    weights = weights.to(x.dtype)
    for ids in (experts, skewed_experts(tokens, K35).cuda()):
        got = routed_experts(x, weights, ids, moe_35b.experts_gate_up, moe_35b.experts_down)
        want = routed_experts_reference(x, weights, ids, moe_35b.experts_gate_up, moe_35b.experts_down)
        assert rel_err(got, want) <= 1e-2
        assert torch.equal(got, routed_experts(x, weights, ids, moe_35b.experts_gate_up, moe_35b.experts_down))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 65, 512])
def test_gpu_moe_block_graph_replay_equals_eager(tokens: int, moe_35b: SparseMoE) -> None:
    """The block with the Triton experts captures into a CUDA graph (no host read) and replays bit-identically."""
    x = torch.randn(1, tokens, H35, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        eager = moe_35b(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe_35b(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = moe_35b(x)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
