"""l2_prefetch: a hint with no result, so its checks are that it compiles for Hopper, that every layout's pieces
lie inside the tensor, aligned, adding up to the bytes asked for, that it rejects what it cannot prefetch, does
nothing off CUDA, and on the GPU runs at real sizes without touching the tensor it reads; and the layers'
`weight_prefetch` settings and side-stream windows."""
from __future__ import annotations

import pytest
import torch
import triton

from dflash_tfm.kernels import TRITON_INTERPRETED
from dflash_tfm.kernels.linear import l2_prefetch as prefetch_module
from dflash_tfm.kernels.linear.l2_prefetch import LAYOUTS, STRIDED_CHUNK_BYTES, l2_prefetch, prefetch_pieces
from dflash_tfm.layers.weight_prefetch import MAX_ROWS, ahead_of, prefetch_bytes, prefetch_layouts, prefetching


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter cannot run inline PTX: nothing to compile")
def test_kernel_compiles_for_hopper() -> None:
    """Triton's sm_90 compiler and ptxas accept the bulk prefetch (a Hopper instruction)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(CHUNK=prefetch_module.CHUNK_BYTES, BLOCK=prefetch_module.BLOCK)
    signature = dict(ptr="*bf16", rows="i32", row_stride="i64", row_bytes="i32") | dict.fromkeys(constexprs,
                                                                                                 "constexpr")
    source = ASTSource(fn=prefetch_module._l2_prefetch_kernel, signature=signature, constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "cp.async.bulk.prefetch.L2.global" in kernel.asm["ptx"]
    assert kernel.asm["cubin"]


def test_cpu_is_a_no_op_and_bad_arguments_are_refused() -> None:
    l2_prefetch(torch.ones(4, 8), 64)  # CPU: nothing to warm
    with pytest.raises(ValueError, match="layout must be one of"):
        l2_prefetch(torch.ones(4, 8), 64, layout="spread")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="contiguous 2-D"):
            l2_prefetch(torch.ones(4, 8, device="cuda").t(), 64)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape, size", [((5120, 6144), 2), ((17408, 5120), 2), ((3, 40), 4), ((1, 2), 2)])
@pytest.mark.parametrize("nbytes", [1, 5000, 24 << 20, 1 << 40])
def test_pieces_lie_inside_aligned_and_add_up(layout: str, shape: tuple[int, int], size: int, nbytes: int) -> None:
    """Every piece inside the tensor and 16-byte aligned; about nbytes in all (whole pieces, rounded to 16
    bytes, at most the tensor); "rows" covers the start of every row (rows of a multiple of 16 bytes, else
    refused), "strided" spans the whole tensor."""
    total = shape[0] * shape[1] * size
    if layout == "rows" and shape[1] * size % 16:
        with pytest.raises(ValueError, match="multiple of 16 bytes"):
            prefetch_pieces(shape, size, nbytes, layout)
        return
    pieces, stride, piece = prefetch_pieces(shape, size, nbytes, layout)
    if total < 16 and layout != "rows":
        assert pieces == 0
        return
    assert pieces >= 1 and piece > 0 and stride % 16 == 0 and piece % 16 == 0
    assert (pieces - 1) * stride + piece <= total and (pieces == 1 or piece <= stride)
    asked = pieces * piece
    slack = {"prefix": 16, "rows": 16 * shape[0], "strided": STRIDED_CHUNK_BYTES}[layout]
    assert asked <= total and asked >= min(nbytes, total // 16 * 16) - slack
    assert asked <= max(nbytes, 16) + slack
    if layout == "rows":
        assert (pieces, stride) == (shape[0], shape[1] * size)
    if layout == "strided" and total >= STRIDED_CHUNK_BYTES:
        assert pieces * stride > total - stride - 16 * pieces and piece == STRIDED_CHUNK_BYTES  # 16-byte rounding


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_prefetch_leaves_the_weight_and_gemm_unchanged(layout: str) -> None:
    """Qwen3.6-27B out_proj (5120 x 6144 bf16): prefetches of part, all and more than all of it, then the GEMM
    gives the same result as before (the prefetch writes nothing) and no launch error surfaces."""
    w = torch.randn(5120, 6144, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(65, 6144, device="cuda", dtype=torch.bfloat16)
    before, w0 = x @ w.t(), w.clone()
    for nbytes in (16, 24 << 20, w.numel() * 2, 10 * w.numel()):
        l2_prefetch(w, nbytes, layout=layout)
    torch.cuda.synchronize()
    assert torch.equal(w, w0) and torch.equal(x @ w.t(), before)


def test_prefetching_sets_per_window_bytes_and_layouts_and_restores_them() -> None:
    before, layouts = prefetch_bytes(), prefetch_layouts()
    with prefetching(mixer=32 << 20, mixer_layout="strided"):
        assert prefetch_bytes() == {"mixer": 32 << 20, "short": before["short"]}
        assert prefetch_layouts() == {"mixer": "strided", "short": layouts["short"]}
        with prefetching(short=8 << 20, short_layout="rows"):
            assert prefetch_bytes() == {"mixer": 32 << 20, "short": 8 << 20}
            assert prefetch_layouts() == {"mixer": "strided", "short": "rows"}
        assert prefetch_bytes()["short"] == before["short"] and prefetch_layouts()["short"] == layouts["short"]
    assert prefetch_bytes() == before and prefetch_layouts() == layouts
    with pytest.raises(ValueError, match=">= 0"):
        with prefetching(short=-1):
            pass
    with pytest.raises(ValueError, match="layouts must be in"):
        with prefetching(mixer_layout="spread"):
            pass
    assert prefetch_bytes() == before and prefetch_layouts() == layouts


def test_ahead_of_runs_the_block_as_it_is_off_cuda() -> None:
    ran = []
    with prefetching(mixer=1 << 20):
        with ahead_of(torch.ones(64, 64), "mixer", torch.ones(3, 64)):
            ran.append(True)
    assert ran == [True]


@pytest.mark.gpu
def test_gpu_ahead_of_in_a_cuda_graph_forks_and_joins() -> None:
    """The side-stream fork and join are captured (the capture would fail on an unjoined stream) and the
    graph's output is the plain computation's, replay after replay; more rows than MAX_ROWS do not fork."""
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(65, 4096, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        with ahead_of(w, "short", x):
            y = torch.nn.functional.silu(x)
        return y @ w.t()

    with prefetching(short=8 << 20):
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.nn.functional.silu(x) @ w.t())
        big = torch.randn(MAX_ROWS + 1, 4096, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.current_stream()
        with ahead_of(w, "short", big):
            assert torch.cuda.current_stream() == stream
