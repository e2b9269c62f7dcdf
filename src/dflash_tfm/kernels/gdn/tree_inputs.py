"""A GDN layer's verify inputs in one launch: tree conv + SiLU, q/k L2 norm, and β, g, from the in_proj output.

Between ``in_proj`` and the tree solve, the unfused verify runs three kernels per GDN layer (β and g, the tree
conv, the q/k L2 norm), each a few µs at 65 tree nodes, mostly launch and ramp. Here one program per
(node, block of BC channels) reads its row and its three nearest ancestors', as ``tree_causal_conv1d`` does, applies
SiLU, and L2-normalises the dk-channel groups of q and k inside its block (BC is a multiple of dk, so no group
straddles two programs); one more program per node computes β and g of its HV heads. The output is one
``[B, N, conv_dim]`` tensor whose q, k, v parts are returned as views.

Semantics: ``gdn_tree_inputs_reference`` (``split_projection`` + ``tree_causal_conv1d`` + ``split_heads``), with
every intermediate rounding to the model dtype reproduced (conv output, normalised q/k, β).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.conv.reference import WIDTH, check_tree_conv_inputs, tree_causal_conv1d_reference
from dflash_tfm.kernels.conv.tree_conv import taps_table, tree_conv_row, unit_stride
from dflash_tfm.kernels.gdn.fused_decode import gdn_gates
from dflash_tfm.kernels.gdn.reference import split_heads, split_projection
from dflash_tfm.kernels.rounding import round_to

MAX_BLOCK = 1024  # channels per program
# Loading all four conv taps at once (the step's ancestor table) lets ptxas keep more in flight: 88 registers at
# 4 warps on sm_90 (ptxas -v) against 76 with the parent-pointer chain, i.e. 5 programs per SM instead of 6, and
# the 715 programs of a 65-node tree at 27B shapes would no longer fit one wave on 132 SMs. Capped at 80 (no
# spills): 6 per SM again.
MAX_REGISTERS = 80


@triton.jit
def l2_normalize_rows(x, dt: tl.constexpr):
    """Rows of the fp32 tile ``x [R, DK]`` times ``rsqrt(Σx² + 1e-6)`` (gated_deltanet.l2_normalize), rounded
    to dt, as fp32."""
    return round_to(x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None], dt)


@triton.jit
def node_inputs(
    proj, weight, nearest, window, a_log, dt_bias, y, keep, beta, g, b, i, c0,
    N, sp_b, sp_n, sw_b, sw_c, swt_c,
    C: tl.constexpr, QK: tl.constexpr, VD: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
    BC: tl.constexpr, HVP: tl.constexpr, KEEP: tl.constexpr,
):
    """Node i's verify inputs for channels c0 … c0 + BC (c0 < C: tree conv + SiLU, q/k groups normalised per
    DK) or, for c0 ≥ C, its β and g. proj: [B, N, C + VD + 2·HV] (unit last stride); y, keep: [B, N, C]
    contiguous; beta, g: [B, N, HV] fp32 contiguous; nearest: `tree_conv_row`. Channels below QK are q and k."""
    dt: tl.constexpr = proj.dtype.element_ty
    if c0 < C:
        offs_c = c0 + tl.arange(0, BC)
        cm = offs_c < C
        acc = tree_conv_row(proj, weight, nearest, window, keep, b, i, N, C, offs_c, cm, cm, sp_b, sp_n, sw_b, sw_c,
                            swt_c, KEEP)
        out = round_to(acc * tl.sigmoid(acc), dt)
        if c0 < QK:  # q/k groups in this block (the ones from QK on are v channels: left as they are)
            groups = tl.reshape(out, [BC // DK, DK])
            normed = l2_normalize_rows(groups, dt)
            first = c0 + tl.arange(0, BC // DK) * DK
            out = tl.reshape(tl.where((first < QK)[:, None], normed, groups), [BC])
        tl.store(y + (b * N + i) * C + offs_c, out.to(dt), mask=cm)
    else:
        heads = tl.arange(0, HVP)
        hm = heads < HV
        row = proj + b * sp_b + i * sp_n + C + VD
        b_raw = tl.load(row + heads, mask=hm, other=0.0).to(tl.float32)
        a_raw = tl.load(row + HV + heads, mask=hm, other=0.0).to(tl.float32)
        bias = tl.load(dt_bias + heads, mask=hm, other=0.0).to(tl.float32)
        decay = tl.load(a_log + heads, mask=hm, other=0.0).to(tl.float32)
        beta_i, g_i = gdn_gates(b_raw, a_raw, bias, decay, dt)
        tl.store(beta + (b * N + i) * HV + heads, beta_i, mask=hm)
        tl.store(g + (b * N + i) * HV + heads, g_i, mask=hm)


@triton.jit
def _gdn_tree_inputs_kernel(
    proj, weight, nearest, window, a_log, dt_bias, y, keep, beta, g,
    N, sp_b, sp_n, sw_b, sw_c, swt_c,
    C: tl.constexpr, QK: tl.constexpr, VD: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
    BC: tl.constexpr, HVP: tl.constexpr, KEEP: tl.constexpr,
):
    """Grid (cdiv(C, BC) + 1, B·N): `node_inputs` of channel block program_id(0) (the last: β, g)."""
    node_inputs(proj, weight, nearest, window, a_log, dt_bias, y, keep, beta, g,
                tl.program_id(1) // N, tl.program_id(1) % N, tl.program_id(0) * BC, N, sp_b, sp_n, sw_b, sw_c, swt_c,
                C, QK, VD, HV, DK, BC, HVP, KEEP)


def gdn_tree_inputs_reference(
    proj: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    parents: torch.Tensor, conv_window: torch.Tensor, hk: int, dk: int, hv: int, dv: int,
    keep_input: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The unfused composition the kernel reproduces -> (q, k, v, z, beta, g)."""
    mixed, z, beta, g = split_projection(proj, A_log, dt_bias, 2 * hk * dk + hv * dv, hv, dv)
    if keep_input is not None:
        keep_input.copy_(mixed)
    conv_out = tree_causal_conv1d_reference(mixed, conv_weight, parents, conv_window)
    return (*split_heads(conv_out, hk, dk, hv, dv), z, beta, g)


def check_tree_inputs_args(
    proj: torch.Tensor, conv_weight: torch.Tensor, parents: torch.Tensor, conv_window: torch.Tensor, hk: int,
    dk: int, hv: int, dv: int, keep_input: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Validate a layer's verify-input arguments (no host sync); returns (B, N, conv_dim)."""
    conv_dim, value_dim = 2 * hk * dk + hv * dv, hv * dv
    if proj.dim() != 3 or proj.shape[-1] != conv_dim + value_dim + 2 * hv:
        raise ValueError(f"proj must be [B, N, {conv_dim + value_dim + 2 * hv}], got {tuple(proj.shape)}")
    B, N, C = check_tree_conv_inputs(proj[..., :conv_dim], parents, conv_window)
    if tuple(conv_weight.shape) != (C, WIDTH):
        raise ValueError(f"conv_weight must be [{C}, {WIDTH}], got {tuple(conv_weight.shape)}")
    if keep_input is not None and (tuple(keep_input.shape) != (B, N, C) or not keep_input.is_contiguous()):
        raise ValueError(f"keep_input must be a contiguous {(B, N, C)} tensor, got {tuple(keep_input.shape)}")
    return B, N, C


def fusable(dk: int, conv_dim: int) -> bool:
    """The kernel's layout needs dk a power of two dividing its channel block."""
    return dk & (dk - 1) == 0 and dk <= min(MAX_BLOCK, triton.next_power_of_2(conv_dim))


def gdn_tree_inputs(
    proj: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    parents: torch.Tensor, conv_window: torch.Tensor, hk: int, dk: int, hv: int, dv: int,
    keep_input: torch.Tensor | None = None, nearest: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """One GDN layer's tree-verify inputs from its in_proj output ``proj [B, N, conv_dim + hv·dv + 2·hv]``:
    returns q, k ``[B, N, hk, dk]`` (conv'd over the tree from ``conv_window [B, conv_dim, 3]``, SiLU,
    L2-normalised), v ``[B, N, hv, dv]``, z ``[B, N, hv, dv]`` (a view of proj), beta and g ``[B, N, hv]`` fp32.
    ``keep_input`` (contiguous ``[B, N, conv_dim]``) also receives the conv inputs, for the commit. The window is
    only read. ``nearest``: the step's `nearest_ancestors(parents)` (built when None). CPU tensors without the
    interpreter, or a dk the kernel cannot tile, run the reference."""
    B, N, C = check_tree_inputs_args(proj, conv_weight, parents, conv_window, hk, dk, hv, dv, keep_input)
    taps = taps_table(parents, nearest)
    if not use_triton(proj) or not fusable(dk, C):
        return gdn_tree_inputs_reference(proj, conv_weight, A_log, dt_bias, parents, conv_window, hk, dk, hv, dv,
                                         keep_input)
    proj, conv_window, conv_weight = unit_stride(proj, conv_window, conv_weight)
    y = torch.empty(B, N, C, dtype=proj.dtype, device=proj.device)
    beta = torch.empty(B, N, hv, dtype=torch.float32, device=proj.device)
    g = torch.empty_like(beta)
    BC = min(MAX_BLOCK, triton.next_power_of_2(C))
    _gdn_tree_inputs_kernel[(triton.cdiv(C, BC) + 1, B * N)](
        proj, conv_weight, taps, conv_window, A_log, dt_bias, y,
        y if keep_input is None else keep_input, beta, g,
        N, *proj.stride()[:2], *conv_window.stride()[:2], conv_weight.stride(0),
        C=C, QK=2 * hk * dk, VD=hv * dv, HV=hv, DK=dk, BC=BC, HVP=triton.next_power_of_2(hv),
        KEEP=keep_input is not None, maxnreg=MAX_REGISTERS)
    return (*input_views(y, proj, hk, dk, hv, dv), beta, g)


def input_views(y: torch.Tensor, proj: torch.Tensor, hk: int, dk: int, hv: int, dv: int) -> tuple[torch.Tensor, ...]:
    """q, k ``[B, N, hk, dk]`` and v ``[B, N, hv, dv]`` as views of the conv output ``y [B, N, conv_dim]``, and z
    ``[B, N, hv, dv]`` as a view of ``proj``."""
    B, N, C = y.shape
    q = y[..., : hk * dk].view(B, N, hk, dk)
    k = y[..., hk * dk: 2 * hk * dk].view(B, N, hk, dk)
    v = y[..., 2 * hk * dk:].view(B, N, hv, dv)
    return q, k, v, proj[..., C: C + hv * dv].view(B, N, hv, dv)
