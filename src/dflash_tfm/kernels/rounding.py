"""Rounding to the model dtype inside Triton kernels, the same on the GPU and under the CPU interpreter."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dt: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``dt``, returned as fp32. bf16 is rounded with integer ops because
    Triton's CPU interpreter truncates fp32 → bf16 casts (the GPU rounds; the result is the same there)."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)
