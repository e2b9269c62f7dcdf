"""One Triton kernel for everything between a GDN layer's ``in_proj`` and ``out_proj`` GEMVs at decode (T = 1).

Per (batch row, value head, dv block) program it reads the layer's in_proj output, runs the width-4 causal
conv + SiLU over [conv window ; new input] for its key head's q and k (recomputed by every program of that key
head, 2·dk channels: cheap) and its own v block, L2-normalises q and k, computes β = σ(b) and
g = −e^A_log · softplus(a + dt_bias), advances its ``[dk, BV]`` fp32 state tile in registers
(S ← e^g S; u = β(v − Sᵀk); S ← S + k uᵀ; o = Sᵀ q·dk^-½, as ``decode.gdn_decode``), and writes
``y = w · rmsnorm(o) · silu(z)`` ready for out_proj. The conv window is shifted in place in the same launch.

Two design points, both without grid-wide synchronisation (Triton has none):

* RMSNorm statistic. The norm needs the whole dv row of o. By default a program owns a whole row
  (``block_v = dv``: B·HV programs, a 128×128 fp32 tile = 64 fp32 registers per thread at 8 warps), so the
  norm is local. ``block_v < dv`` splits the row over dv/BV programs for more parallelism at batch 1: each
  stores its o block (already rounded to the output dtype, exactly what the unfused path feeds the norm) into
  ``y`` and its Σo² into a scratch slot, then bumps a per-row arrival counter (CTA barrier, then one
  acq_rel atomic); the program that arrives last reads the row back through L2 (``.cg``), normalises it and
  resets the counter to 0. No program ever waits, so there is no deadlock whatever the scheduling.
* Conv window. v channels of a dv block are read and written by the one program that owns the block (a CTA
  barrier separates its window loads from its stores). The q/k channels of a key head are read by all
  ``(HV/HK)·(dv/BV)`` programs of that head, so none may shift them while another may still read the old
  values: each program, after reading, arrives on a per-(batch, key head) counter (CTA barrier, then one
  acq_rel atomic), and the last to arrive re-reads the old window and the new input (nobody else writes
  them) and writes the shifted window, then resets the counter. Alternatively the caller passes
  ``window_out`` (a second buffer, e.g. a double buffer it swaps): then the window is read from
  ``conv_window``, written to ``window_out`` by one designated program per channel, and no counter is used.

The counters live in a small zero-initialised int32 buffer per device, allocated on first use and left at
zero by every launch, so the launch does no host sync and allocates nothing after the first call (CUDA-graph
capturable once warmed up). Launches on one device share the counters, so they must be stream ordered (one
decode stream, as the engine runs its layers). Semantics: ``gdn_fused_decode_reference``, the composition of
``gdn_inputs`` + window copy + GDN recurrence + ``gated_rms_norm``; every intermediate rounding of that
composition to the model dtype is reproduced (q, k, v, β, o, the normalised o and w·normed).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.gdn.reference import gdn_inputs, gdn_recurrent_reference
from dflash_tfm.kernels.norm.reference import gated_rms_norm
from dflash_tfm.kernels.rounding import round_to

CONV_WIDTH = 4


@triton.jit
def _conv_silu(p_b, w_b, cw_ptr, ch, mask, sp_c, sw_c, sw_k, scw_c, scw_k):
    """Causal conv (width 4, fp32 accumulation) + SiLU of channels ``ch`` for one new input.

    Returns, all as fp32 holding values of proj's dtype: the output, and the new window (w1, w2, x) (the old
    window is cast to proj's dtype first, as ``causal_conv1d`` does).
    """
    dt: tl.constexpr = p_b.dtype.element_ty
    x = tl.load(p_b + ch * sp_c, mask=mask, other=0.0).to(tl.float32)
    w_row = w_b + ch * sw_c
    w0 = round_to(tl.load(w_row, mask=mask, other=0.0).to(tl.float32), dt)
    w1 = round_to(tl.load(w_row + sw_k, mask=mask, other=0.0).to(tl.float32), dt)
    w2 = round_to(tl.load(w_row + 2 * sw_k, mask=mask, other=0.0).to(tl.float32), dt)
    c_row = cw_ptr + ch * scw_c
    acc = w0 * tl.load(c_row, mask=mask, other=0.0).to(tl.float32)
    acc += w1 * tl.load(c_row + scw_k, mask=mask, other=0.0).to(tl.float32)
    acc += w2 * tl.load(c_row + 2 * scw_k, mask=mask, other=0.0).to(tl.float32)
    acc += x * tl.load(c_row + 3 * scw_k, mask=mask, other=0.0).to(tl.float32)
    return round_to(acc * tl.sigmoid(acc), dt), w1, w2, x


@triton.jit
def _store_window(w_b, ch, mask, sw_c, sw_k, w1, w2, x):
    """Window of channels ``ch`` ← (w1, w2, x), oldest first, in the window's dtype (exact casts: the values
    are already representable in proj's dtype)."""
    wt = w_b.dtype.element_ty
    w_row = w_b + ch * sw_c
    tl.store(w_row, w1.to(wt), mask=mask)
    tl.store(w_row + sw_k, w2.to(wt), mask=mask)
    tl.store(w_row + 2 * sw_k, x.to(wt), mask=mask)


@triton.jit
def _shift_qk_window(p_b, w_b, wo_b, i_hk, sp_c, sw_c, sw_k, swo_c, swo_k,
                     HK: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, BARRIER: tl.constexpr):
    """New window of key head i_hk's q and k channels, re-read from the old window and proj (nobody else writes
    them), so the conv's values need not stay live in registers until here."""
    dt: tl.constexpr = p_b.dtype.element_ty
    offs = tl.arange(0, 2 * BK)
    in_k = offs >= BK
    d = tl.where(in_k, offs - BK, offs)
    ch = tl.where(in_k, HK * DK, 0) + i_hk * DK + d
    mask = d < DK
    x = tl.load(p_b + ch * sp_c, mask=mask, other=0.0).to(tl.float32)
    w_row = w_b + ch * sw_c
    w1 = round_to(tl.load(w_row + sw_k, mask=mask, other=0.0).to(tl.float32), dt)
    w2 = round_to(tl.load(w_row + 2 * sw_k, mask=mask, other=0.0).to(tl.float32), dt)
    if BARRIER:  # in place: every thread's reads of the old window precede every thread's writes
        tl.debug_barrier()
    _store_window(wo_b, ch, mask, swo_c, swo_k, w1, w2, x)


@triton.jit
def _l2_normalize(x, dt: tl.constexpr):
    """``x · rsqrt(Σx² + 1e-6)`` (gated_deltanet.l2_normalize) rounded to dt, as fp32; masked lanes stay 0."""
    return round_to(x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6), dt)


@triton.jit
def gdn_decay(a, dt_bias, a_log):
    """fp32 in, fp32 out: g = −e^A_log · softplus(a + dt_bias) (``split_projection``)."""
    x = a + dt_bias
    e = tl.exp(tl.minimum(x, 20.0))  # F.softplus: x above its threshold 20, else log1p(e^x)
    u1 = 1.0 + e
    log1p_e = tl.where(u1 == 1.0, e, tl.log(u1) * (e / tl.where(u1 == 1.0, 1.0, u1 - 1.0)))  # accurate log1p
    return -tl.exp(a_log) * tl.where(x > 20.0, x, log1p_e)


@triton.jit
def gdn_gates(b, a, dt_bias, a_log, dt: tl.constexpr):
    """fp32 in, fp32 out: β = σ(b) rounded to dt (as torch.sigmoid on a dt tensor) and g (`gdn_decay`)."""
    return round_to(tl.sigmoid(b), dt), gdn_decay(a, dt_bias, a_log)


@triton.jit
def _gated_norm(o, z, nw, sum_sq, eps, DV: tl.constexpr, dt: tl.constexpr, ROUND_PROD: tl.constexpr):
    """``gated_rms_norm``: (w · rmsnorm(o).to(dt) [rounded when w has dt] · silu(z)).to(dt)."""
    normed = round_to(o * tl.rsqrt(sum_sq / DV + eps), dt)
    wn = nw * normed
    if ROUND_PROD:
        wn = round_to(wn, dt)
    return round_to(wn * (z * tl.sigmoid(z)), dt).to(dt)


@triton.jit
def _gdn_fused_decode_kernel(
    p_ptr, cw_ptr, win_ptr, wout_ptr, alog_ptr, dtb_ptr, nw_ptr, s_ptr, y_ptr, cnt_ptr, part_ptr,
    scale, eps, norm_cnt_off,
    sp_b, sp_c,
    scw_c, scw_k,
    sw_b, sw_c, sw_k,
    swo_b, swo_c, swo_k,
    ss_b, ss_h, ss_k, ss_v,
    sy_b, sy_c,
    HK: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr, NB: tl.constexpr, BNB: tl.constexpr,
    IN_PLACE: tl.constexpr, ROUND_PROD: tl.constexpr,
):
    """Program (b·HV + hv, dv block). proj [B, ·] laid out [q | k | v | z | b | a]; see the module docstring."""
    dt: tl.constexpr = p_ptr.dtype.element_ty
    CONV: tl.constexpr = 2 * HK * DK + HV * DV
    i_bh = tl.program_id(0)
    i_blk = tl.program_id(1)
    i_b = (i_bh // HV).to(tl.int64)
    i_hv = i_bh % HV
    i_hk = i_hv // GROUP
    offs_k = tl.arange(0, BK)
    offs_v = i_blk * BV + tl.arange(0, BV)
    mask_k = offs_k < DK
    mask_v = offs_v < DV

    # The state tile first: its loads (the bulk of the traffic) are in flight while the inputs are prepared.
    s_ptrs = s_ptr + i_b * ss_b + i_hv * ss_h + offs_k[:, None] * ss_k + offs_v[None, :] * ss_v
    mask_s = mask_k[:, None] & mask_v[None, :]
    S = tl.load(s_ptrs, mask=mask_s, other=0.0)

    p_b = p_ptr + i_b * sp_b
    w_b = win_ptr + i_b * sw_b
    # q and k channels interleaved in one 2·BK vector (q_0 k_0 q_1 k_1 …): with at least as many elements as
    # the CTA has threads, Triton keeps its loads in a compact layout (about one channel per thread) and moves
    # the results to the state tile's layout once, instead of re-doing the conv of every q/k channel in each
    # lane that holds that row of the tile (16 channels × 9 loads per thread at 8 warps: register spills).
    offs_qk = tl.arange(0, 2 * BK)
    d_qk = offs_qk // 2
    ch_qk = (offs_qk % 2) * (HK * DK) + i_hk * DK + d_qk
    qk, _, _, _ = _conv_silu(p_b, w_b, cw_ptr, ch_qk, d_qk < DK, sp_c, sw_c, sw_k, scw_c, scw_k)
    q, k = tl.split(tl.reshape(qk, (BK, 2)))
    q = _l2_normalize(q, dt) * scale
    k = _l2_normalize(k, dt)
    ch_v = 2 * HK * DK + i_hv * DV + offs_v
    v, v1, v2, vx = _conv_silu(p_b, w_b, cw_ptr, ch_v, mask_v, sp_c, sw_c, sw_k, scw_c, scw_k)

    # Conv window: v channels are owned by this program; q/k channels are written once, after every reader.
    wo_b = wout_ptr + i_b * swo_b
    if IN_PLACE:
        tl.debug_barrier()  # all of this CTA's window loads are done before any thread stores or arrives
        qk_cnt = cnt_ptr + i_b * HK + i_hk
        arrived = tl.atomic_add(qk_cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == GROUP * NB - 1:  # the last reader of this key head's q/k window
            _shift_qk_window(p_b, w_b, wo_b, i_hk, sp_c, sw_c, sw_k, swo_c, swo_k, HK, DK, BK, True)
            tl.atomic_xchg(qk_cnt, 0, sem="relaxed", scope="gpu")
    else:
        if (i_hv % GROUP == 0) & (i_blk == 0):
            _shift_qk_window(p_b, w_b, wo_b, i_hk, sp_c, sw_c, sw_k, swo_c, swo_k, HK, DK, BK, False)
    _store_window(wo_b, ch_v, mask_v, swo_c, swo_k, v1, v2, vx)

    b = tl.load(p_b + (CONV + HV * DV + i_hv) * sp_c).to(tl.float32)
    a = tl.load(p_b + (CONV + HV * DV + HV + i_hv) * sp_c).to(tl.float32)
    beta, g = gdn_gates(b, a, tl.load(dtb_ptr + i_hv).to(tl.float32), tl.load(alog_ptr + i_hv).to(tl.float32), dt)

    S = S * tl.exp(g)
    u = beta * (v - tl.sum(S * k[:, None], axis=0))
    S = S + k[:, None] * u[None, :]
    o = round_to(tl.sum(S * q[:, None], axis=0), dt)  # o in the model dtype, as the unfused path has it

    y_b = y_ptr + i_b * sy_b + i_hv * DV * sy_c
    z_b = p_b + (CONV + i_hv * DV) * sp_c
    if NB == 1:
        tl.store(s_ptrs, S, mask=mask_s)
        z = tl.load(z_b + offs_v * sp_c, mask=mask_v, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        y = _gated_norm(o, z, nw, tl.sum(o * o, axis=0), eps, DV, dt, ROUND_PROD)
        tl.store(y_b + offs_v * sy_c, y, mask=mask_v)
    else:
        tl.store(y_b + offs_v * sy_c, o.to(dt), mask=mask_v)
        tl.store(part_ptr + i_bh * NB + i_blk, tl.sum(o * o, axis=0))
        tl.debug_barrier()  # the whole CTA's o / Σo² stores precede the release below
        row_cnt = cnt_ptr + norm_cnt_off + i_bh
        arrived = tl.atomic_add(row_cnt, 1, sem="acq_rel", scope="gpu")
        tl.store(s_ptrs, S, mask=mask_s)  # after the arrival, so that its fence need not wait for these stores
        if arrived == NB - 1:  # the last block of this row: every o block and partial sum is visible
            offs_r = tl.arange(0, BDV)
            mask_r = offs_r < DV
            offs_p = tl.arange(0, BNB)
            parts = tl.load(part_ptr + i_bh * NB + offs_p, mask=offs_p < NB, other=0.0, cache_modifier=".cg")
            o_row = tl.load(y_b + offs_r * sy_c, mask=mask_r, other=0.0, cache_modifier=".cg").to(tl.float32)
            z = tl.load(z_b + offs_r * sp_c, mask=mask_r, other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
            y = _gated_norm(o_row, z, nw, tl.sum(parts, axis=0), eps, DV, dt, ROUND_PROD)
            tl.store(y_b + offs_r * sy_c, y, mask=mask_r)
            tl.atomic_xchg(row_cnt, 0, sem="relaxed", scope="gpu")


# Per-device scratch, grown on demand: int32 arrival counters (zero-initialised, left at zero by every launch)
# and fp32 partial sums Σo² (no initial value needed). Two buffers, so a launch's partial sums can never land
# on another launch's counters. A grown-out buffer is kept alive (never freed) because a CUDA graph captured
# earlier may still point at it.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_PARTIALS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def _scratch(
    cache: dict[torch.device, torch.Tensor], device: torch.device, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    buf = cache.get(device)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(1024, triton.next_power_of_2(numel)), dtype=dtype, device=device)
        cache[device] = buf
    return buf


def _check_shapes(
    proj: torch.Tensor, conv_weight: torch.Tensor, conv_window: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, norm_weight: torch.Tensor, state: torch.Tensor, hk: int, dk: int, hv: int, dv: int,
) -> int:
    """Validate the fused-decode operands; returns the batch size B."""
    conv_dim = 2 * hk * dk + hv * dv
    if hv % hk:
        raise ValueError(f"hv={hv} must be a multiple of hk={hk}")
    if proj.dim() != 3 or proj.shape[1] != 1 or proj.shape[2] != conv_dim + hv * dv + 2 * hv:
        raise ValueError(
            f"proj must be [B, 1, {conv_dim + hv * dv + 2 * hv}] (one decode token), got {tuple(proj.shape)}")
    B = proj.shape[0]
    if tuple(conv_weight.shape) != (conv_dim, CONV_WIDTH):
        raise ValueError(f"conv_weight must be [{conv_dim}, {CONV_WIDTH}], got {tuple(conv_weight.shape)}")
    if tuple(conv_window.shape) != (B, conv_dim, CONV_WIDTH - 1):
        raise ValueError(f"conv_window must be [{B}, {conv_dim}, {CONV_WIDTH - 1}], got {tuple(conv_window.shape)}")
    if tuple(A_log.shape) != (hv,) or tuple(dt_bias.shape) != (hv,) or tuple(norm_weight.shape) != (dv,):
        raise ValueError(f"A_log, dt_bias must be [{hv}] and norm_weight [{dv}], got "
                         f"{tuple(A_log.shape)}, {tuple(dt_bias.shape)}, {tuple(norm_weight.shape)}")
    if tuple(state.shape) != (B, hv, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 [{B}, {hv}, {dk}, {dv}], got {state.dtype} {tuple(state.shape)}")
    return B


def _check_out(out: torch.Tensor | None, proj: torch.Tensor, B: int, hv: int, dv: int) -> torch.Tensor:
    if out is None:
        return torch.empty(B, 1, hv * dv, dtype=proj.dtype, device=proj.device)
    if tuple(out.shape) != (B, 1, hv * dv) or out.dtype != proj.dtype:
        raise ValueError(f"out must be {proj.dtype} [{B}, 1, {hv * dv}], got {out.dtype} {tuple(out.shape)}")
    return out


def gdn_fused_decode_reference(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_window: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    state: torch.Tensor,
    *,
    hk: int,
    dk: int,
    hv: int,
    dv: int,
    eps: float,
    out: torch.Tensor | None = None,
    window_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-PyTorch twin of ``gdn_fused_decode``: the unfused composition, run eagerly.

    ``gdn_inputs`` → ``conv_window.copy_(new_window)`` (or into ``window_out``) → recurrent GDN step (state
    updated in place) → ``gated_rms_norm``. Returns ``y [B, 1, hv·dv]`` in proj's dtype.
    """
    B = _check_shapes(proj, conv_weight, conv_window, A_log, dt_bias, norm_weight, state, hk, dk, hv, dv)
    out = _check_out(out, proj, B, hv, dv)
    q, k, v, z, beta, g, new_window = gdn_inputs(
        proj, conv_weight, conv_window, A_log, dt_bias, hk, dk, hv, dv)
    (conv_window if window_out is None else window_out).copy_(new_window)
    o, final_state = gdn_recurrent_reference(q, k, v, g, beta, state)
    state.copy_(final_state)
    y = gated_rms_norm(o, z, norm_weight, eps)
    return out.copy_(y.reshape(B, 1, hv * dv))


def gdn_fused_decode(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_window: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    state: torch.Tensor,
    *,
    hk: int,
    dk: int,
    hv: int,
    dv: int,
    eps: float,
    out: torch.Tensor | None = None,
    window_out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """One GDN decode step from the in_proj output to the out_proj input, in one kernel launch.

    proj ``[B, 1, conv_dim + hv·dv + 2·hv]`` laid out [q | k | v | z | b | a] (any strides; conv_dim =
    2·hk·dk + hv·dv), conv_weight ``[conv_dim, 4]``, conv_window ``[B, conv_dim, 3]`` (oldest first, shifted
    in place unless ``window_out`` is given: then it is only read and the new window goes to ``window_out``),
    A_log, dt_bias ``[hv]``, norm_weight ``[dv]``, state ``[B, hv, dk, dv]`` fp32 (updated in place). Returns
    ``y [B, 1, hv·dv]`` in proj's dtype (written into ``out`` when given) = ``gated_rms_norm(o, z)``.

    Runs the Triton kernel on CUDA or under ``TRITON_INTERPRET=1``, else ``gdn_fused_decode_reference``.
    Tuning: ``block_v`` (power of two, default dv: one program per value head; smaller splits the norm's row
    over programs that meet on a counter) and ``num_warps`` (default: 64 state elements per thread, ≤ 8).
    The first launch on a device allocates its counters (do it before a CUDA-graph capture); launches on one
    device share them, so they must be stream ordered (no two in flight at once on different streams).
    """
    B = _check_shapes(proj, conv_weight, conv_window, A_log, dt_bias, norm_weight, state, hk, dk, hv, dv)
    out = _check_out(out, proj, B, hv, dv)
    if window_out is not None and tuple(window_out.shape) != tuple(conv_window.shape):
        raise ValueError(f"window_out must be {tuple(conv_window.shape)}, got {tuple(window_out.shape)}")
    if window_out is conv_window:
        window_out = None
    if not use_triton(proj):
        return gdn_fused_decode_reference(
            proj, conv_weight, conv_window, A_log, dt_bias, norm_weight, state,
            hk=hk, dk=dk, hv=hv, dv=dv, eps=eps, out=out, window_out=window_out)

    BK, BDV = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    BV = BDV if block_v is None else min(block_v, BDV)
    if BV & (BV - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    NB = triton.cdiv(dv, BV)
    if num_warps is None:
        # 128 state elements per thread: 4 warps for a 128x128 tile (H200, 27B shapes: 7.8 us per layer
        # against 9.9 us with 8 warps, benchmarks/bench_gdn_fused_decode.py)
        num_warps = max(1, min(8, BK * BV // (128 * 32)))
    counters = _scratch(_COUNTERS, proj.device, B * (hk + hv), torch.int32)  # [B·hk] q/k, then [B·hv] rows
    partials = _scratch(_PARTIALS, proj.device, B * hv * NB if NB > 1 else 1, torch.float32)
    wout = conv_window if window_out is None else window_out

    grid = (B * hv, NB)
    _gdn_fused_decode_kernel[grid](
        proj, conv_weight, conv_window, wout, A_log, dt_bias, norm_weight, state, out, counters, partials,
        dk**-0.5, eps, B * hk,
        proj.stride(0), proj.stride(2),
        *conv_weight.stride(),
        *conv_window.stride(),
        *wout.stride(),
        *state.stride(),
        out.stride(0), out.stride(2),
        HK=hk, HV=hv, GROUP=hv // hk, DK=dk, DV=dv, BK=BK, BV=BV, BDV=BDV, NB=NB,
        BNB=triton.next_power_of_2(NB), IN_PLACE=window_out is None,
        ROUND_PROD=norm_weight.dtype == proj.dtype,
        num_warps=num_warps,
    )
    return out
