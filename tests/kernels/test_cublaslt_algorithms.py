"""cuBLASLt's ranked algorithms as projection candidates: each one against ``F.linear``, eagerly and replayed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_tfm.kernels.linear import cublaslt_algorithms as lt
from dflash_tfm.layers import linear as linear_module

from .test_tree_common import rel_err


def test_no_candidates_off_the_gpu() -> None:
    """CPU tensors and fp32 have no cuBLASLt candidates (the projection keeps its other ones)."""
    assert lt.problem(65, 64, 32, torch.bfloat16, torch.device("cpu")) is None
    assert lt.problem(65, 64, 32, torch.float32, torch.device("cuda")) is None


def test_a_refused_shape_warns_once_and_offers_no_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuBLASLt failing for a shape (or nvmath built for other CUDA bindings) removes the candidates, it does
    not break the projection."""
    calls = []

    def refuse(*args) -> None:
        calls.append(args)
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(lt, "bindings", lambda: ("cublasLt", "cublas", "types"))
    monkeypatch.setattr(lt, "LtProblem", refuse)
    monkeypatch.setattr(lt, "_problems", {})
    with pytest.warns(UserWarning, match="NOT_SUPPORTED"):
        assert lt.problem(65, 64, 32, torch.bfloat16, torch.device("cuda")) is None
    assert lt.problem(65, 64, 32, torch.bfloat16, torch.device("cuda")) is None
    assert len(calls) == 1


def test_algorithm_index_reads_the_rank_from_the_name() -> None:
    assert lt.algorithm_index("cublaslt#0 id 21 tile 64x128 stages 64x6 split-k 1 cluster 1x1x1") == 0
    assert lt.algorithm_index("cublaslt#7 id 66") == 7


needs_nvmath = pytest.mark.skipif(lt.bindings() is None, reason="nvmath-python is not installed")


@pytest.mark.gpu
@needs_nvmath
@pytest.mark.parametrize("rows", [16, 65])
@pytest.mark.parametrize("N, K", [(34816, 5120), (5120, 17408), (5120, 6144)])
def test_gpu_every_algorithm_matches_cublas_27b_shapes(rows: int, N: int, K: int) -> None:
    """Qwen3.6-27B projections (bf16): every ranked algorithm agrees with cuBLAS to bf16 rounding, also when
    captured in a CUDA graph and replayed on new inputs; misaligned operands fall back to ``F.linear``."""
    x = torch.randn(1, rows, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    problem = lt.problem(rows, N, K, x.dtype, x.device)
    assert problem is not None and len(problem.names) >= 1
    assert [lt.algorithm_index(name) for name in problem.names] == list(range(len(problem.names)))
    for i in range(len(problem.names)):
        assert rel_err(problem.run(x, w, i), F.linear(x, w)) <= 1e-2, problem.names[i]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = problem.run(x, w, len(problem.names) - 1)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_err(out, F.linear(x, w)) <= 1e-2
    shifted = torch.randn(rows * K + 8, device="cuda", dtype=torch.bfloat16)[8:].view(1, rows, K)  # 16 B off
    assert torch.equal(problem.run(shifted, w, 0), F.linear(shifted, w))


@pytest.mark.gpu
@needs_nvmath
def test_gpu_projection_dispatches_a_forced_algorithm() -> None:
    """The measured choice offers the algorithms, and `linear` runs the one recorded for the shape."""
    x = torch.randn(65, 5120, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 5120, device="cuda", dtype=torch.bfloat16) / 5120**0.5
    names = [n for n in linear_module._candidates(x, w, 65) if n.startswith(linear_module.LT_PREFIX)]
    assert names
    key = (65, *w.shape, x.dtype, w.dtype, x.device)
    linear_module.projection_choice.choices[key] = names[-1]
    try:
        with linear_module.skinny_projections():
            assert rel_err(linear_module.linear(x, w), F.linear(x, w)) <= 1e-2
    finally:
        del linear_module.projection_choice.choices[key]
