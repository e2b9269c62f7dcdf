"""Gated DeltaNet decode step: a Triton kernel that advances the fp32 state in place over a few tokens.

Decode is memory bound (at 27B shapes each layer's state is 48·128·128 fp32 = 3 MiB), so each program
owns one ``[dk, BV]`` tile of one (batch, value head) state, reads it once, runs all T tokens on it in
registers and writes it once. The launch does no host sync and allocates nothing data dependent, so it
can be captured in a CUDA graph. T is a compile-time constant (the token loop is unrolled; one compile per
distinct T, and triton 3.6's interpreter cannot loop to a runtime bound with numpy 2.4).
Semantics: ``reference.gdn_recurrent_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels.gdn.reference import gdn_recurrent_reference, gdn_shapes

# Triton's CPU interpreter (TRITON_INTERPRET=1) only works when the variable is set before triton is first
# imported (tl.sum & co are built then), so read it once: the kernel below is interpreted iff this is True.
_INTERPRET = bool(triton.knobs.runtime.interpret)


@triton.jit
def _gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr,
    scale,
    sq_b, sq_t, sq_h, sq_d,
    sk_b, sk_t, sk_h, sk_d,
    sv_b, sv_t, sv_h, sv_d,
    sg_b, sg_t, sg_h,
    sbeta_b, sbeta_t, sbeta_h,
    ss_b, ss_h, ss_k, ss_v,
    so_b, so_t, so_h, so_d,
    T: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    """Program (b·HV + hv, dv block), T times: S ← e^g S; u = β(v − Sᵀk); S ← S + k uᵀ; o = Sᵀ(q·scale)."""
    i_bh = tl.program_id(0)
    i_b = (i_bh // HV).to(tl.int64)
    i_hv = i_bh % HV
    i_hk = i_hv // GROUP
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]

    s_ptrs = s_ptr + i_b * ss_b + i_hv * ss_h + offs_k[:, None] * ss_k + offs_v[None, :] * ss_v
    S = tl.load(s_ptrs, mask=mask_s, other=0.0)
    q_ptrs = q_ptr + i_b * sq_b + i_hk * sq_h + offs_k * sq_d
    k_ptrs = k_ptr + i_b * sk_b + i_hk * sk_h + offs_k * sk_d
    v_ptrs = v_ptr + i_b * sv_b + i_hv * sv_h + offs_v * sv_d
    o_ptrs = o_ptr + i_b * so_b + i_hv * so_h + offs_v * so_d
    g_ptr_b = g_ptr + i_b * sg_b + i_hv * sg_h
    beta_ptr_b = beta_ptr + i_b * sbeta_b + i_hv * sbeta_h
    for t in tl.static_range(T):
        q = tl.load(q_ptrs + t * sq_t, mask=mask_k, other=0.0).to(tl.float32) * scale
        k = tl.load(k_ptrs + t * sk_t, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptrs + t * sv_t, mask=mask_v, other=0.0).to(tl.float32)
        g = tl.load(g_ptr_b + t * sg_t).to(tl.float32)
        beta = tl.load(beta_ptr_b + t * sbeta_t).to(tl.float32)
        S = S * tl.exp(g)
        u = beta * (v - tl.sum(S * k[:, None], axis=0))
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptrs + t * so_t, o.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(s_ptrs, S, mask=mask_s)


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    block_v: int = 16,
    num_warps: int = 1,
) -> torch.Tensor:
    """Advance ``state [B, HV, dk, dv]`` (fp32, updated in place) over T decode tokens and return ``o``.

    q, k ``[B, T, HK, dk]`` (L2-normalised), v ``[B, T, HV, dv]``, g and beta ``[B, T, HV]``; any strides.
    ``o [B, T, HV, dv]`` has ``v``'s dtype and is written into ``out`` when given. Runs the Triton kernel on
    CUDA or under ``TRITON_INTERPRET=1``, else the fp32 reference. ``block_v`` (a power of two) and
    ``num_warps`` are tuning knobs for the kernel (see ``benchmarks/bench_gdn_decode.py``).
    """
    B, T, HK, r, dk, dv = gdn_shapes(q, k, v, g, beta)
    HV = HK * r
    scale = dk**-0.5 if scale is None else scale
    if tuple(state.shape) != (B, HV, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 [{B}, {HV}, {dk}, {dv}], got {state.dtype} {tuple(state.shape)}")
    if out is None:
        out = torch.empty(B, T, HV, dv, dtype=v.dtype, device=v.device)
    elif tuple(out.shape) != (B, T, HV, dv):
        raise ValueError(f"out must be [{B}, {T}, {HV}, {dv}], got {tuple(out.shape)}")

    if not (v.is_cuda or _INTERPRET):
        o, final_state = gdn_recurrent_reference(q, k, v, g, beta, state, scale)
        state.copy_(final_state)
        return out.copy_(o)

    if block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    BK = triton.next_power_of_2(dk)
    BV = min(block_v, triton.next_power_of_2(dv))
    grid = (B * HV, triton.cdiv(dv, BV))
    _gdn_decode_kernel[grid](
        q, k, v, g, beta, state, out,
        scale,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *state.stride(), *out.stride(),
        T=T, HV=HV, GROUP=r, DK=dk, DV=dv, BK=BK, BV=BV,
        num_warps=num_warps,
    )
    return out
