"""Tree causal depthwise conv1d (width 4, SiLU) for the GDN input q|k|v, and its commit.

One program per (node, channel block): it reads the node's row and its three nearest ancestors' (the step's
`nearest_ancestors` table, continuing above the root into the committed window), so every node's output is
the plain causal conv over its root→node path preceded by the window. The window is never written during
verify; the commit gathers the last three inputs of the accepted path (one program per channel block).
Shapes and conventions: ``reference.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.conv.reference import (
    WIDTH,
    check_tree_conv_inputs,
    tree_causal_conv1d_reference,
    tree_conv_commit_reference,
)
from dflash_tfm.tree import nearest_ancestors


@triton.jit
def _up(parents, b, N, a):
    """One step up: the parent of node a ≥ 0, else a − 1 (above the root, −1 −2 −3 are window slots 2 1 0)."""
    return tl.where(a >= 0, tl.load(parents + b * N + tl.maximum(a, 0)), a - 1)


@triton.jit
def _input_at(x, window, b, a, offs_c, cm, sx_b, sx_n, sw_b, sw_c):
    """Conv input of chain index a (tree row if a ≥ 0, else window slot 3 + a) for channels offs_c, fp32."""
    in_tree = x + b * sx_b + tl.maximum(a, 0) * sx_n + offs_c
    in_window = window + b * sw_b + offs_c * sw_c + tl.maximum(a + 3, 0)
    if x.dtype.element_ty == window.dtype.element_ty:  # one load through whichever pointer applies
        return tl.load(tl.where(a >= 0, in_tree, in_window), mask=cm, other=0.0).to(tl.float32)
    else:
        tree_row = tl.load(in_tree, mask=cm & (a >= 0), other=0.0).to(tl.float32)
        return tl.where(a >= 0, tree_row, tl.load(in_window, mask=cm & (a < 0), other=0.0).to(tl.float32))


@triton.jit
def tree_conv_row(
    x, weight, nearest, window, keep, b, i, N, C, offs_c, cm, keep_mask, sx_b, sx_n, sw_b, sw_c, swt_c,
    KEEP: tl.constexpr,
):
    """fp32 ``Σ_t w[:, 3−t] · x_{anc_t(i)}`` (no activation) of node i's channels offs_c, the ancestors read from
    ``nearest`` (contiguous int32 ``[B, N, 3]``, `nearest_ancestors`: all taps load at once, no chain of
    parent loads): i a node with offs_c ``[BC]``, or rows i ``[BT, 1]`` (each < N) with offs_c ``[1, BC]`` for a
    ``[BT, BC]`` tile; cm masks the loads. KEEP also stores the nodes' own inputs into the contiguous
    ``keep [B, N, C]`` where keep_mask."""
    x_t = _input_at(x, window, b, i, offs_c, cm, sx_b, sx_n, sw_b, sw_c)  # t = 0: the node itself
    if KEEP:
        tl.store(keep + (b * N + i) * C + offs_c, x_t.to(keep.dtype.element_ty), mask=keep_mask)
    acc = tl.load(weight + offs_c * swt_c + 3, mask=offs_c < C, other=0.0).to(tl.float32) * x_t
    for t in tl.static_range(1, 4):  # weight column 3 − t; chain index: an ancestor, or a window slot (< 0)
        a = tl.load(nearest + (b * N + i) * 3 + (t - 1))
        w_t = tl.load(weight + offs_c * swt_c + (3 - t), mask=offs_c < C, other=0.0).to(tl.float32)
        acc += w_t * _input_at(x, window, b, a, offs_c, cm, sx_b, sx_n, sw_b, sw_c)
    return acc


@triton.jit
def _tree_conv_kernel(
    x, weight, nearest, window, y, keep,
    N, C, sx_b, sx_n, sw_b, sw_c, swt_c, sy_b, sy_n,
    BC: tl.constexpr, SILU: tl.constexpr, KEEP: tl.constexpr,
):
    """Grid (cdiv(C, BC), B·N). x, y: [B, N, C]; weight: [C, 4]; window: [B, C, 3]; keep (if KEEP): a
    contiguous [B, N, C] copy of x, stored by the program that loads each row anyway."""
    b = tl.program_id(1) // N
    i = tl.program_id(1) % N
    offs_c = tl.program_id(0) * BC + tl.arange(0, BC)
    cm = offs_c < C
    acc = tree_conv_row(x, weight, nearest, window, keep, b, i, N, C, offs_c, cm, cm, sx_b, sx_n, sw_b, sw_c, swt_c,
                        KEEP)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + b * sy_b + i * sy_n + offs_c, acc.to(y.dtype.element_ty), mask=cm)


@triton.jit
def _tree_conv_commit_kernel(
    x, parents, accepted, window, out,
    N, C, PATHS, sx_b, sx_n, sw_b, sw_c,
    BC: tl.constexpr, NPOW: tl.constexpr,
):
    """Grid (cdiv(C, BC), B). out: [B, C, 3], slot 2 = the deepest accepted node's input; batch row b follows
    tree and path b % PATHS. All three inputs are loaded before any store, so `out` may be `window` itself
    (each program owns its channels)."""
    b = tl.program_id(1)
    p = b % PATHS
    offs_c = tl.program_id(0) * BC + tl.arange(0, BC)
    cm = offs_c < C
    nodes = tl.arange(0, NPOW)
    on_path = tl.load(accepted + p * N + nodes, mask=nodes < N, other=0) != 0
    a = tl.max(tl.where(on_path, nodes, -1), axis=0)  # parents precede children: deepest = largest index
    newest = _input_at(x, window, b, a, offs_c, cm, sx_b, sx_n, sw_b, sw_c)
    a = _up(parents, p, N, a)
    middle = _input_at(x, window, b, a, offs_c, cm, sx_b, sx_n, sw_b, sw_c)
    a = _up(parents, p, N, a)
    oldest = _input_at(x, window, b, a, offs_c, cm, sx_b, sx_n, sw_b, sw_c)
    row = out + (b * C + offs_c) * 3
    tl.store(row + 2, newest.to(out.dtype.element_ty), mask=cm)
    tl.store(row + 1, middle.to(out.dtype.element_ty), mask=cm)
    tl.store(row, oldest.to(out.dtype.element_ty), mask=cm)


def unit_stride(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels index the last dimension directly."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def taps_table(parents: torch.Tensor, nearest: torch.Tensor | None) -> torch.Tensor:
    """The conv kernels' contiguous int32 ``[B, N, 3]`` ancestor table: ``nearest`` (the step's
    `nearest_ancestors`, checked against parents' shape), or built from ``parents`` when None."""
    if nearest is None:
        return nearest_ancestors(parents)
    if tuple(nearest.shape) != (*parents.shape, 3) or nearest.dtype != torch.int32:
        raise ValueError(f"nearest must be int32 {(*parents.shape, 3)} (nearest_ancestors(parents)), got "
                         f"{nearest.dtype} {tuple(nearest.shape)}")
    return nearest.contiguous()


def tree_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, parents: torch.Tensor, conv_window: torch.Tensor,
    activation: str | None = "silu", keep_input: torch.Tensor | None = None, nearest: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y_i = act(Σ_t w[:, 3−t] · x_{anc_t(i)})`` for every tree node; the window is only read.

    x ``[B, N, C]``, weight ``[C, 4]``, parents ``[B, N]``, conv_window ``[B, C, 3]`` (most recent last).
    Returns ``y [B, N, C]`` in x's dtype (fp32 accumulation). ``keep_input`` (contiguous, x's shape) also
    receives x: a slice of a layer-stacked buffer lets the commit read every layer's inputs in one launch,
    without a stacking copy of x (which is usually a strided view of the input projection). ``nearest``: the
    step's `nearest_ancestors(parents)` table ``[B, N, 3]`` int32, built here when None.
    """
    B, N, C = check_tree_conv_inputs(x, parents, conv_window)
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if tuple(weight.shape) != (C, WIDTH):
        raise ValueError(f"weight must be [{C}, {WIDTH}], got {tuple(weight.shape)}")
    if keep_input is not None and (keep_input.shape != x.shape or not keep_input.is_contiguous()):
        raise ValueError(f"keep_input must be a contiguous {tuple(x.shape)} tensor, got {tuple(keep_input.shape)}")
    taps = taps_table(parents, nearest)
    if not use_triton(x):
        if keep_input is not None:
            keep_input.copy_(x)
        return tree_causal_conv1d_reference(x, weight, parents, conv_window, activation)
    x, weight, conv_window = unit_stride(x, weight, conv_window)
    y = torch.empty(B, N, C, dtype=x.dtype, device=x.device)
    BC = min(1024, triton.next_power_of_2(C))
    _tree_conv_kernel[(triton.cdiv(C, BC), B * N)](
        x, weight, taps, conv_window, y, y if keep_input is None else keep_input, N, C, *x.stride()[:2],
        *conv_window.stride()[:2], weight.stride(0), *y.stride()[:2], BC=BC, SILU=activation == "silu",
        KEEP=keep_input is not None)
    return y


def tree_conv_commit(
    x: torch.Tensor, parents: torch.Tensor, accepted: torch.Tensor, conv_window: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """New conv window ``[B, C, 3]`` (in conv_window's dtype): the last three inputs along the accepted path
    ``accepted [B, N]`` (bool, root included), falling back into the old window. ``parents`` and ``accepted``
    may instead have P rows, B a multiple of P: row b then follows tree and path b % P (layers stacked along
    the batch share one tree). ``out`` (contiguous, may be ``conv_window`` itself: the commit then happens in
    place) receives it; by default a new tensor."""
    B, N, C = check_tree_conv_inputs(x, parents, conv_window, shared_trees=True)
    paths = parents.shape[0]
    if tuple(accepted.shape) != tuple(parents.shape):
        raise ValueError(f"accepted must be parents' shape {tuple(parents.shape)}, got {tuple(accepted.shape)}")
    if not use_triton(x):
        window = tree_conv_commit_reference(x, parents.repeat(B // paths, 1), accepted.repeat(B // paths, 1),
                                            conv_window)
        return window if out is None else out.copy_(window)
    if out is not None and (not out.is_contiguous() or out.shape != conv_window.shape):
        raise ValueError(f"out must be a contiguous {tuple(conv_window.shape)} tensor")
    x, parents = unit_stride(x, parents.contiguous())
    window = conv_window if conv_window.stride(-1) == 1 or out is conv_window else conv_window.contiguous()
    acc = accepted.contiguous()
    acc = acc.view(torch.uint8) if acc.dtype == torch.bool else acc.to(torch.uint8)
    out = torch.empty(B, C, WIDTH - 1, dtype=conv_window.dtype, device=x.device) if out is None else out
    BC = min(1024, triton.next_power_of_2(C))
    _tree_conv_commit_kernel[(triton.cdiv(C, BC), B)](
        x, parents, acc, window, out, N, C, paths, *x.stride()[:2], *window.stride()[:2],
        BC=BC, NPOW=triton.next_power_of_2(N))
    return out
