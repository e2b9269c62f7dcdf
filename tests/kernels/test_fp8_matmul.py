"""The FP8 weight-stream matmul against its twin (dequantise, then F.linear): Triton's interpreter on the CPU at
small sizes, the 27B projection shapes on a GPU; and the block format's quantise / dequantise round trip."""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.kernels.fp8.block_quant import (
    BLOCK, FP8_MAX, dequantize_rows, expand_block_scales, quantize_blocks, scale_shape,
)
from dflash_tfm.kernels.fp8.reference import fp8_matmul_reference
from dflash_tfm.kernels.fp8.weight_stream import LAUNCHES, Fp8StreamConfig, fp8_matmul, launches_for, stream_config

from .test_tree_common import rel_err, triton_device  # noqa: F401  (fixture)


def fp8_weight(n: int, k: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A random FP8 weight and its per-row scales (block scales spread over three orders of magnitude)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 0, -(-n // BLOCK) * -(-k // BLOCK)).view(
        -(-n // BLOCK), -(-k // BLOCK)).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    q, scale = quantize_blocks(w)
    return q.to(device), expand_block_scales(scale, n).to(device)


CASES = [  # rows, N, K, config: N and K off the 128 grid, split-K 1 and 3, several row tiles
    (1, 40, 300, Fp8StreamConfig(block_n=32)),
    (3, 200, 384, Fp8StreamConfig(block_n=64, split_k=2)),
    (17, 72, 260, Fp8StreamConfig(block_n=16, split_k=3)),
    (65, 33, 128, Fp8StreamConfig(block_n=32, num_warps=8)),
    (1, 40, 300, Fp8StreamConfig(block_n=16, gemv=True)),
    (1, 70, 900, Fp8StreamConfig(block_n=32, split_k=2, gemv=True, sub_blocks=2)),
]


@pytest.mark.parametrize("rows, N, K, config", CASES, ids=[f"{m}x{n}x{k}-split{c.split_k}{'-gemv' if c.gemv else ''}" for m, n, k, c in CASES])
def test_triton_fp8_matmul_matches_twin(rows: int, N: int, K: int, config: Fp8StreamConfig, triton_device: str) -> None:
    w, scale = fp8_weight(N, K, seed=rows, device=triton_device)
    x = torch.randn(1, rows, K, generator=torch.Generator().manual_seed(rows + 1)).to(triton_device)
    y = fp8_matmul(x, w, scale, config)
    assert y.shape == (1, rows, N) and y.dtype == x.dtype
    assert rel_err(y, fp8_matmul_reference(x, w, scale)) <= 1e-5


def test_triton_fp8_matmul_applies_each_blocks_scale(triton_device: str) -> None:
    """Zeroing one (row, K block) scale changes exactly that output column (a kernel reading the wrong scale
    column or row fails)."""
    w, scale = fp8_weight(130, 256, seed=3, device=triton_device)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4)).to(triton_device)
    config = Fp8StreamConfig(block_n=32)
    before = fp8_matmul(x, w, scale, config)
    scale = scale.clone()
    scale[5, 1] = 0.0
    after = fp8_matmul(x, w, scale, config)
    assert rel_err(after, fp8_matmul_reference(x, w, scale)) <= 1e-5
    changed = (after - before).abs().amax(dim=0) > 0
    assert changed[5] and changed.sum() == 1


def test_quantize_round_trip_within_e4m3_precision() -> None:
    """Each element comes back within half an e4m3 step of its block's scale: relative error ≤ 2^-4 of its value,
    or 2^-9 · scale near zero (subnormals); the block's largest value is exactly representable."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen) * 3
    q, scale = quantize_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == scale_shape(w.shape) == (3, 2)
    back = dequantize_rows(q, expand_block_scales(scale, 300), torch.float32)
    per_element = expand_block_scales(scale, 300).repeat_interleave(BLOCK, -1)[:, :200]
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + per_element * 2 ** -9).all()
    assert torch.allclose(q.float().abs().amax(), torch.tensor(FP8_MAX))


def test_quantize_blocks_handles_stacks_and_zero_blocks() -> None:
    w = torch.zeros(2, 130, 5)
    w[1, 129, 4] = 7.0
    q, scale = quantize_blocks(w)
    assert scale.shape == (2, 2, 1) and scale[0].eq(1).all() and scale[1, 1, 0] == 7.0 / FP8_MAX
    assert dequantize_rows(q, expand_block_scales(scale, 130), torch.float32).equal(w)


def test_stream_config_splits_k_until_the_gpu_is_full() -> None:
    """The MLP down projection (5120 × 17408) at one row: 80 column tiles, split-K 3 for two programs per SM on
    132 SMs; the GEMV of 16-wide tiles at four per SM: 320 tiles, no split; 65 rows: fewer stages fit."""
    assert stream_config(1, 5120, 17408, sms=132) == Fp8StreamConfig(64, 3, 4, 4)
    assert stream_config(65, 248320, 5120, sms=132).split_k == 1
    assert stream_config(65, 5120, 5120, sms=132, launch=LAUNCHES["tiles n128 w8"]).num_stages == 3
    gemv = stream_config(1, 5120, 17408, sms=132, launch=LAUNCHES["gemv n16 k4 w8"])
    assert gemv == Fp8StreamConfig(16, 2, 8, 2, gemv=True, sub_blocks=4)
    assert launches_for(1) == tuple(LAUNCHES) and not any(LAUNCHES[n].gemv for n in launches_for(16))


SHAPES_27B = {"mlp gate_up": (34816, 5120), "mlp down": (5120, 17408), "gdn in_proj": (16480, 5120),
              "attention qkv": (14336, 5120), "o_proj": (5120, 6144)}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 65])
@pytest.mark.parametrize("name", list(SHAPES_27B))
def test_fp8_matmul_at_27b_shapes(name: str, rows: int) -> None:
    """Every launch the tuned choice may take, at every 27B projection and row count."""
    N, K = SHAPES_27B[name]
    w, scale = fp8_weight(N, K, seed=rows, device="cuda")
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    reference = fp8_matmul_reference(x.float(), w, scale)  # fp32 twin: the kernel's roundings are bf16 ones
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for launch in launches_for(rows):
        y = fp8_matmul(x, w, scale, stream_config(rows, N, K, sms, LAUNCHES[launch]))
        assert rel_err(y, reference) <= 1e-2, launch
