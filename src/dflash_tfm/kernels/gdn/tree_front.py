"""The front of a GDN layer's chunk tree verify in one launch: the verify inputs and the Gram tiles.

The chunk solve (`tree_verify.py`) starts with its Gram kernel, which reads the q, k that the verify-inputs
kernel (`tree_inputs.py`: tree conv, SiLU, L2 norm) has just written: two launches in a row, each a few µs
of dependent loads at 65 nodes. Here one launch does both. Node programs compute the v channels and β, g of
one node (`node_inputs`, as the inputs kernel does); Gram programs, one per (row block i, column block j ≤ i,
key head), compute the q, k rows they need from the in_proj output themselves (the tree conv of BT rows × dk
channels, recomputed rather than read back), store their ancestor-masked Gram tiles (`store_gram_tile`) and,
in column block 0, the path decays G from the raw ``a`` projections (`path_decay_rows`). Diagonal programs
(j = i) also store their q, k rows and, for the commit, the rows' conv inputs. The solve then takes the tiles
(`gdn_tree_verify(gram=…)`) and skips its Gram launch.

Every program that needs a row computes it with the same code from the same data, so the tiles and the
stored q, k agree exactly. Twin: ``gdn_tree_inputs_reference`` and ``tree_gram_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.conv.tree_conv import taps_table, tree_conv_row, unit_stride
from dflash_tfm.kernels.gdn.tree_inputs import (
    check_tree_inputs_args,
    gdn_tree_inputs_reference,
    input_views,
    l2_normalize_rows,
    node_inputs,
)
from dflash_tfm.kernels.gdn.tree_reference import GramTiles, tree_gram_reference
from dflash_tfm.kernels.gdn.tree_verify import (
    default_solve_precision,
    native_gram_dots,
    path_decay_rows,
    store_gram_tile,
)
from dflash_tfm.kernels.rounding import round_to
from dflash_tfm.spec.tree import ancestor_bitsets

# v channels per node program: the Gram programs' conv tiles (BT × dk, three per program) set the kernel's
# registers (255 on sm_90 at 4 warps with bf16 dots, ptxas -v: two programs per SM), so node programs take wide
# blocks: fewer programs, fewer waves.
MAX_BLOCK = 2048


@triton.jit
def _qk_rows(proj, weight, nearest, window, keep, b, rows, c0, N, sp_b, sp_n, sw_b, sw_c, swt_c, store_keep,
             C: tl.constexpr, DK: tl.constexpr, KEEP: tl.constexpr):
    """q or k rows ``rows`` (channels c0 … c0 + DK of the conv input) as the inputs kernel makes them: tree conv,
    SiLU, L2 norm, each rounded to the model dtype; [BT, DK] in that dtype, zero past N. KEEP and store_keep:
    the rows' conv inputs also go to ``keep``."""
    dt: tl.constexpr = proj.dtype.element_ty
    rm = (rows < N)[:, None]
    offs_c = c0 + tl.arange(0, DK)[None, :]
    cm = rm & (offs_c < C)
    acc = tree_conv_row(proj, weight, nearest, window, keep, b, tl.minimum(rows, N - 1)[:, None], N, C, offs_c, cm,
                        cm & store_keep, sp_b, sp_n, sw_b, sw_c, swt_c, KEEP)
    return l2_normalize_rows(round_to(acc * tl.sigmoid(acc), dt), dt).to(dt)


@triton.jit(do_not_specialize=["N", "W", "NB", "NP", "GRAM_PROGRAMS"])  # one compile for every tree size
def _gdn_tree_front_kernel(
    proj, weight, nearest, window, a_log, dt_bias, bits, y, keep, beta, g, kk, qk, G,
    N, W, NB, HK, R, NP, GRAM_PROGRAMS, scale, sp_b, sp_n, sw_b, sw_c, swt_c,
    C: tl.constexpr, QK: tl.constexpr, VD: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
    BC: tl.constexpr, HVP: tl.constexpr, RP: tl.constexpr, BT: tl.constexpr, KEEP: tl.constexpr,
    PREC: tl.constexpr, NATIVE: tl.constexpr,
):
    """1-D grid: B·HK·NB(NB+1)/2 Gram programs (key head, then row block i and column block j ≤ i), the longer
    ones, first; then (cdiv(C − QK, BC) + 1)·B·N node programs (v channels from QK on, then β and g), from
    GRAM_PROGRAMS on. Layouts: `node_inputs`; kk, qk [B, HK, NP, NP]; G [B, N, HV] fp32."""
    pid = tl.program_id(0)
    if pid >= GRAM_PROGRAMS:
        blocks = tl.cdiv(C - QK, BC) + 1
        node = (pid - GRAM_PROGRAMS) // blocks
        node_inputs(proj, weight, nearest, window, a_log, dt_bias, y, keep, beta, g, node // N, node % N,
                    QK + ((pid - GRAM_PROGRAMS) % blocks) * BC, N, sp_b, sp_n, sw_b, sw_c, swt_c, C, QK, VD, HV, DK,
                    BC, HVP, KEEP)
    else:
        pairs = NB * (NB + 1) // 2
        bh = pid // pairs
        t = pid % pairs  # the t-th block pair of the lower triangle, row by row: t = i(i + 1)/2 + j
        i = ((tl.sqrt(8.0 * t + 1.0) - 1.0) * 0.5).to(tl.int32)
        i = tl.where((i + 1) * (i + 2) // 2 <= t, i + 1, tl.where(i * (i + 1) // 2 > t, i - 1, i))
        j = t - i * (i + 1) // 2
        b = bh // HK
        h = bh % HK
        diag = j == i
        rows = i * BT + tl.arange(0, BT)
        q_i = _qk_rows(proj, weight, nearest, window, keep, b, rows, h * DK, N, sp_b, sp_n, sw_b, sw_c, swt_c,
                       diag, C, DK, KEEP)
        k_i = _qk_rows(proj, weight, nearest, window, keep, b, rows, QK // 2 + h * DK, N, sp_b, sp_n, sw_b,
                       sw_c, swt_c, diag, C, DK, KEEP)
        if diag:
            k_j = k_i
            out = y + (b * N + rows[:, None]) * C + h * DK + tl.arange(0, DK)[None, :]
            tl.store(out, q_i, mask=(rows < N)[:, None])
            tl.store(out + QK // 2, k_i, mask=(rows < N)[:, None])
        else:
            k_j = _qk_rows(proj, weight, nearest, window, keep, b, j * BT + tl.arange(0, BT), QK // 2 + h * DK,
                           N, sp_b, sp_n, sw_b, sw_c, swt_c, False, C, DK, KEEP)
        if not NATIVE:  # the Gram dots at PREC take fp32 (the values are exact either way)
            q_i, k_i, k_j = q_i.to(tl.float32), k_i.to(tl.float32), k_j.to(tl.float32)
        store_gram_tile(kk, qk, bits + b * N * W, q_i, k_i, k_j, rows, j, bh, N, W, NP, scale, BT, PREC,
                        NATIVE)
        if j == 0:
            path_decay_rows(proj, bits + b * N * W, G + b * N * HV, rows, N, W, h * R, R, HV,
                            b * sp_b + C + VD + HV, sp_n, 1, a_log, dt_bias, RP, True)


def gdn_tree_front(
    proj: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    parents: torch.Tensor, conv_window: torch.Tensor, ancestors: torch.Tensor | None, hk: int, dk: int, hv: int,
    dv: int, scale: float | None = None, block_size: int = 16, gram_native: bool = True,
    keep_input: torch.Tensor | None = None, G_out: torch.Tensor | None = None, nearest: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, GramTiles]:
    """`gdn_tree_inputs` (same arguments and outputs q, k, v, z, beta, g) plus the chunk solve's `GramTiles`
    for ``gdn_tree_verify(…, gram=…)``, in one launch. ``ancestors``: the step's bitsets (built from parents
    when None); ``scale`` (default dk^-0.5), ``block_size`` and ``gram_native`` as in `gdn_tree_verify`;
    ``G_out`` (contiguous fp32 ``[B, N, hv]``) receives G; ``nearest``: the step's `nearest_ancestors(parents)`
    (built when None). CPU tensors without the interpreter, or a dk that is not a power of two, run the twin."""
    B, N, C = check_tree_inputs_args(proj, conv_weight, parents, conv_window, hk, dk, hv, dv, keep_input)
    if block_size not in (16, 32):
        raise ValueError(f"block_size must be 16 or 32, got {block_size}")
    if G_out is not None and (tuple(G_out.shape) != (B, N, hv) or G_out.dtype != torch.float32
                              or not G_out.is_contiguous()):
        raise ValueError(f"G_out must be a contiguous fp32 {(B, N, hv)} tensor, got {tuple(G_out.shape)}")
    scale = dk**-0.5 if scale is None else scale
    bits = (ancestor_bitsets(parents) if ancestors is None else ancestors).contiguous()
    taps = taps_table(parents, nearest)
    if not use_triton(proj) or dk & (dk - 1):
        q, k, v, z, beta, g = gdn_tree_inputs_reference(proj, conv_weight, A_log, dt_bias, parents, conv_window,
                                                        hk, dk, hv, dv, keep_input)
        gram = tree_gram_reference(q, k, g, bits, scale, block_size)
        if G_out is not None:
            gram = GramTiles(kk=gram.kk, qk=gram.qk, G=G_out.copy_(gram.G))
        return q, k, v, z, beta, g, gram
    proj, conv_window, conv_weight = unit_stride(proj, conv_window, conv_weight)
    dev, f32 = proj.device, torch.float32
    y = torch.empty(B, N, C, dtype=proj.dtype, device=dev)
    beta, g = torch.empty(B, N, hv, dtype=f32, device=dev), torch.empty(B, N, hv, dtype=f32, device=dev)
    nb = triton.cdiv(N, block_size)
    NP = nb * block_size
    kk = torch.empty(B, hk, NP, NP, dtype=f32, device=dev)
    qk = torch.empty_like(kk)
    G = torch.empty(B, N, hv, dtype=f32, device=dev) if G_out is None else G_out
    QK = 2 * hk * dk
    BC = min(MAX_BLOCK, triton.next_power_of_2(C - QK))
    gram_programs = nb * (nb + 1) // 2 * B * hk
    _gdn_tree_front_kernel[(gram_programs + (triton.cdiv(C - QK, BC) + 1) * B * N,)](
        proj, conv_weight, taps, conv_window, A_log, dt_bias, bits, y,
        y if keep_input is None else keep_input, beta, g, kk, qk, G,
        N, bits.shape[-1], nb, hk, hv // hk, NP, gram_programs, scale,
        *proj.stride()[:2], *conv_window.stride()[:2], conv_weight.stride(0),
        C=C, QK=QK, VD=hv * dv, HV=hv, DK=dk, BC=BC, HVP=triton.next_power_of_2(hv),
        RP=max(16, triton.next_power_of_2(hv // hk)), BT=block_size, KEEP=keep_input is not None,
        PREC=default_solve_precision(proj.dtype, N), NATIVE=native_gram_dots(gram_native, proj.dtype),
        num_warps=4 if block_size == 16 else 8)
    return (*input_views(y, proj, hk, dk, hv, dv), beta, g, GramTiles(kk=kk, qk=qk, G=G))
