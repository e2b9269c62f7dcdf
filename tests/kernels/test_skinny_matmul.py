"""The Triton skinny matmul against its twin F.linear (Triton's interpreter on the CPU, real sizes on the GPU),
and the projection dispatch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from dflash_tfm.kernels import TRITON_INTERPRETED
from dflash_tfm.kernels.linear import skinny_matmul as skinny_module
from dflash_tfm.kernels.linear.skinny_matmul import SkinnyConfig, skinny_matmul, tile_config
from dflash_tfm.layers import linear as linear_module

from .test_tree_common import rel_err, triton_device  # noqa: F401  (fixture)

CASES = [  # rows, N, K, config: split-K 1 and 3 (K not a multiple of the split), N and K off the tile grid
    (1, 40, 96, SkinnyConfig(block_n=32, block_k=32, split_k=2)),
    (2, 40, 96, SkinnyConfig(block_n=32, block_k=32)),
    (17, 72, 160, SkinnyConfig(block_n=64, block_k=32, split_k=3)),
    (65, 33, 64, SkinnyConfig(block_n=16, block_k=16, split_k=2, num_warps=8)),
    (1, 40, 96, SkinnyConfig(block_n=32, block_k=32, tma=True)),
    (2, 40, 96, SkinnyConfig(block_n=32, block_k=32, tma=True)),
    (17, 72, 160, SkinnyConfig(block_n=64, block_k=32, split_k=3, tma=True)),
    (65, 33, 64, SkinnyConfig(block_n=16, block_k=16, split_k=2, tma=True)),
]


@pytest.mark.parametrize("rows, N, K, config", CASES,
                         ids=[f"{m}x{n}x{k}-split{c.split_k}{'-tma' * c.tma}" for m, n, k, c in CASES])
def test_triton_skinny_matmul_matches_linear(rows: int, N: int, K: int, config: SkinnyConfig, triton_device: str) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, K, generator=gen).to(triton_device)
    w = torch.randn(N, K, generator=gen).to(triton_device)
    y = skinny_matmul(x, w, config)
    assert y.shape == (1, rows, N) and y.dtype == x.dtype
    assert rel_err(y, F.linear(x, w)) <= 1e-5


def test_triton_tma_config_on_unaligned_operands_falls_back_to_pointer_loads(triton_device: str) -> None:
    """A TMA configuration given a view whose base is not 16-byte aligned (or a strided one) still computes the
    product, through the pointer-load kernel."""
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(3, 97, generator=gen).to(triton_device)
    w = torch.randn(24, 96, generator=gen).to(triton_device)
    x = big[:, 1:]  # 4-byte offset and rows of 97 elements
    assert not skinny_module.tma_ready(x, w) and skinny_module.tma_ready(w)
    config = SkinnyConfig(block_n=16, block_k=32, tma=True)
    assert rel_err(skinny_matmul(x, w, config), F.linear(x, w)) <= 1e-5


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter replaces the kernels: nothing to compile")
def test_tma_kernel_compiles_for_hopper() -> None:
    """The TMA kernel compiles to sm_90 code at a verify shape (Triton's compiler and ptxas; no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(BM=128, BN=64, BK=128)
    signature = dict(x_desc="tensordesc<bf16[128, 128]>", w_desc="tensordesc<bf16[64, 128]>", out="*fp32", M="i32",
                     N="i32", K="i32", k_per_split="i32", som="i32", son="i32", sos="i32")
    source = ASTSource(fn=skinny_module._skinny_matmul_tma_kernel,
                       signature=signature | dict.fromkeys(constexprs, "constexpr"), constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    assert kernel.asm["cubin"]


def test_tiles_split_k_until_the_gpu_is_full() -> None:
    """A 5120 x 17408 projection (the MLP down) at one row has 80 column tiles of 64: split-K brings it to >= 2
    programs per SM, with 4 pipeline stages; the lm_head has tiles enough without."""
    assert tile_config(1, 5120, 17408, 64, 128, sms=132, tma=True) == SkinnyConfig(64, 128, 4, 4, 4, tma=True)
    assert tile_config(16, 248320, 5120, 128, 128, sms=132, tma=False).split_k == 1


def test_projection_candidates_follow_the_row_count() -> None:
    """Skinny tiles up to 16 rows, two cuBLAS column parts for tree verify's rows and wide weights."""
    names = lambda rows, n: [name for name, _ in linear_module.candidates(rows, torch.empty(n, 8))]  # noqa: E731
    assert names(1, 17408) == ["cublas", "cublaslt", *linear_module.SKINNY]
    assert names(65, 34816) == ["cublas", "cublaslt", "cublas/2"]
    assert names(65, 5120) == ["cublas", "cublaslt"]
    assert set(names(16, 34816) + names(65, 34816)) == set(linear_module.PROJECTION.candidates)


def test_dispatch_runs_linear_off_cuda_and_rejects_a_width_mismatch() -> None:
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    assert torch.equal(linear_module.linear(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match="features"):
        skinny_matmul(torch.randn(3, 15), w)


@pytest.mark.parametrize("parts", [2, 4])
def test_cublas_in_parts_equals_one_gemm(parts: int) -> None:
    """Column slices of one output, one GEMM each (a 3-D input, as verify passes it), and a clear error when
    the parts would not be 16-byte aligned."""
    x, w = torch.randn(2, 33, 40), torch.randn(64, 40)
    assert torch.allclose(linear_module.cublas_in_parts(x, w, parts), F.linear(x, w), atol=1e-5)
    with pytest.raises(ValueError, match="aligned parts"):
        linear_module.cublas_in_parts(x, w[:60], parts)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 65])
def test_gpu_dispatch_matches_cublas_27b_shapes(rows: int) -> None:
    """Qwen3.6-27B projections (bf16): whichever kernel the tuning picks agrees with cuBLAS to bf16 rounding, and
    so does every candidate itself."""
    for N, K in [(34816, 5120), (5120, 17408), (5120, 6144), (12288 + 2 * 1024 + 2 * 48, 5120)]:
        x = torch.randn(1, rows, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        ref = F.linear(x, w)
        with linear_module.skinny_projections():
            assert rel_err(linear_module.linear(x, w), ref) <= 1e-2
        before = torch.backends.cuda.preferred_blas_library()
        for name, fn in linear_module.candidates(rows, w):
            assert rel_err(fn(x, w), ref) <= 1e-2, name
        assert torch.backends.cuda.preferred_blas_library() == before  # cuBLASLt's process-wide preference restored
        if N % 32 == 0:
            assert rel_err(linear_module.cublas_in_parts(x, w, 4), ref) <= 1e-2


@pytest.mark.gpu
def test_gpu_verify_with_skinny_projections_matches_cublas_and_captures() -> None:
    """A target whose projections are large enough to be timed: verify over a 65-node tree with the measured
    kernels (eagerly and as a CUDA-graph replay) agrees with the all-cuBLAS verify."""
    from dflash_tfm.config import ModelConfig
    from dflash_tfm.engine.model_runner import ModelRunner
    from dflash_tfm.loading.loader import build_model
    from dflash_tfm.models.random_init import init_random_
    from dflash_tfm.tree import TreeSpec, random_parents

    cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=4096, hidden_size=2048, intermediate_size=4096,
                                     num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                     rms_norm_eps=1e-6, max_position_embeddings=512, rope_theta=10000.0,
                                     tie_word_embeddings=False))
    model = init_random_(build_model(cfg, torch.device("cuda"), torch.bfloat16, max_positions=512), seed=1)
    runner = ModelRunner(model, max_len=256, device=torch.device("cuda"))
    runner.prefill(torch.randint(0, 4096, (40,)))
    parents = random_parents(65, "best_first", seed=2).cuda()
    tree = TreeSpec.build(torch.randint(0, 4096, (1, 65), device="cuda"), parents.view(1, -1), cache_len=40)

    def verify() -> torch.Tensor:
        hidden, _, _ = model.verify(tree, runner.cache, 40)
        return model.logits(hidden[0])

    with torch.inference_mode():
        ref = verify()
        with linear_module.skinny_projections():
            eager = verify()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = verify()
            graph.replay()
    assert rel_err(eager, ref) <= 2e-2 and torch.equal(replayed, eager)
