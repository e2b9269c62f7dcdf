"""Pure-PyTorch twins of the GDN tree-verify kernels, and the sequential oracle they are tested against.

Per value head (KERNELS.md): path log-decay ``G = P g``; ``A_ij = β_i e^(G_i−G_j) k_i·k_j`` for j ∈ anc(i);
``(I + A) U = diag(β)(V − diag(e^G) K S0)``; ``O = diag(e^G) Q S0 + (QKᵀ ∘ D) U`` with
``D_ij = e^(G_i−G_j)`` for j ∈ anc⁺(i). Because every node only sees its ancestors, each node's output
equals plain sequential decoding of its root→node path. The verify pass writes no state; the commit
folds the accepted path: ``S* = e^(G_last) S0 + Σ_{j∈path} e^(G_last−G_j) k_j u_jᵀ``.

Shapes: q, k ``[B, N, HK, dk]`` (L2-normalised; q is multiplied by ``scale``, default ``dk**-0.5``);
v ``[B, N, HV, dv]`` with value head j reading key head ``j // (HV/HK)``; g (≤ 0), β ``[B, N, HV]``;
parents ``[B, N]`` (−1 for the root, parents before children); initial_state ``[B, HV, dk, dv]`` fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_tfm.tree import ancestor_mask, unpack_bitsets

F32 = torch.float32


@dataclass
class GDNTreeContext:
    """What the commit needs from a verify pass. The initial state is referenced, never modified.

    Chunk kernel / reference (fold): ``k [B, N, HK, dk]``, ``u [B, N, HV, dv]`` fp32 (solved rows),
    ``G [B, N, HV]`` fp32 (cumulative path log-decay). Recurrent baseline: ``snapshots [B, N, HV, dk, dv]``
    fp32, the state after every node (commit picks the deepest accepted one).
    """

    initial_state: torch.Tensor
    k: torch.Tensor | None = None
    u: torch.Tensor | None = None
    G: torch.Tensor | None = None
    snapshots: torch.Tensor | None = None


def check_gdn_tree_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    parents: torch.Tensor, initial_state: torch.Tensor,
) -> tuple[int, int, int, int, int, int, int]:
    """Validate shapes (no host sync) and return ``(B, N, HK, HV, r, dk, dv)``."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, N, HK, dk] of equal shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    B, N, HK, dk = q.shape
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, N) or v.shape[2] % HK != 0:
        raise ValueError(f"v must be [B, N, HV, dv] with HV a multiple of HK={HK}, got {tuple(v.shape)}")
    HV, dv = v.shape[2], v.shape[3]
    if tuple(g.shape) != (B, N, HV) or tuple(beta.shape) != (B, N, HV):
        raise ValueError(f"g and beta must be [{B}, {N}, {HV}], got {tuple(g.shape)}, {tuple(beta.shape)}")
    if tuple(parents.shape) != (B, N):
        raise ValueError(f"parents must be [{B}, {N}], got {tuple(parents.shape)}")
    if tuple(initial_state.shape) != (B, HV, dk, dv):
        raise ValueError(f"initial_state must be [{B}, {HV}, {dk}, {dv}], got {tuple(initial_state.shape)}")
    return B, N, HK, HV, HV // HK, dk, dv


def gdn_tree_verify_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    parents: torch.Tensor, initial_state: torch.Tensor, scale: float | None = None,
    ancestors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, GDNTreeContext]:
    """Ancestor-masked dense solve in fp32 (KERNELS.md steps 1–4). Returns ``o [B, N, HV, dv]`` in
    v's dtype and the fold context. ``ancestors`` (bitsets ``[B, N, W]``) skips rebuilding them."""
    B, N, HK, HV, r, dk, dv = check_gdn_tree_inputs(q, k, v, g, beta, parents, initial_state)
    scale = dk**-0.5 if scale is None else scale
    mask = ancestor_mask(parents) if ancestors is None else unpack_bitsets(ancestors, N)  # [B, N, N]
    strict = mask & ~torch.eye(N, dtype=torch.bool, device=q.device)
    qf = (q.to(F32) * scale).transpose(1, 2)                      # [B, HK, N, dk]
    kf = k.to(F32).transpose(1, 2)
    vf = v.to(F32).transpose(1, 2)                                # [B, HV, N, dv]
    bf = beta.to(F32).transpose(1, 2)                             # [B, HV, N]
    G = torch.einsum("bij,bjh->bih", mask.to(F32), g.to(F32))     # [B, N, HV]
    Gh = G.transpose(1, 2)
    D = (Gh[..., :, None] - Gh[..., None, :]).masked_fill(~mask[:, None], float("-inf")).exp()
    # Gram matrices once per key head, then shared by its r value heads.
    KK = (kf @ kf.transpose(-1, -2)).repeat_interleave(r, dim=1)  # [B, HV, N, N]
    QK = (qf @ kf.transpose(-1, -2)).repeat_interleave(r, dim=1)
    kh, qh = kf.repeat_interleave(r, dim=1), qf.repeat_interleave(r, dim=1)
    S0 = initial_state.to(F32)
    A = bf[..., None] * D * KK * strict[:, None]
    rhs = bf[..., None] * (vf - Gh.exp()[..., None] * (kh @ S0))
    eye = torch.eye(N, dtype=F32, device=q.device)
    U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)  # [B, HV, N, dv]
    O = Gh.exp()[..., None] * (qh @ S0) + (QK * D) @ U
    ctx = GDNTreeContext(initial_state=initial_state, k=k, u=U.transpose(1, 2).contiguous(), G=G)
    return O.transpose(1, 2).to(v.dtype), ctx


def deepest_accepted(accepted: torch.Tensor) -> torch.Tensor:
    """Index of the last node of the accepted root→node path ``[B]`` (−1 if nothing is accepted).

    Parents precede children, so the deepest node of a path is its largest index. No host sync.
    """
    idx = torch.arange(accepted.shape[-1], device=accepted.device)
    return torch.where(accepted.bool(), idx, -1).amax(-1)


def gdn_tree_commit_reference(ctx: GDNTreeContext, accepted: torch.Tensor) -> torch.Tensor:
    """New fp32 state ``[B, HV, dk, dv]`` after the accepted path ``accepted [B, N]`` (bool mask).

    Fold: ``S* = e^(G_last) S0 + Σ_{j∈path} e^(G_last−G_j) k_j u_jᵀ`` (no re-solve); with snapshots
    (recurrent baseline) the deepest accepted node's state. Nothing accepted → a copy of S0.
    """
    S0 = ctx.initial_state.to(F32)
    last = deepest_accepted(accepted)                             # [B]
    b = torch.arange(last.shape[0], device=last.device)
    if ctx.snapshots is not None:
        snap = ctx.snapshots[b, last.clamp(min=0)]
        return torch.where((last >= 0)[:, None, None, None], snap, S0)
    G_last = torch.where((last >= 0)[:, None], ctx.G[b, last.clamp(min=0)], 0.0)  # [B, HV]
    w = (G_last[:, None] - ctx.G).masked_fill(~accepted.bool()[..., None], float("-inf")).exp()  # [B, N, HV]
    r = ctx.u.shape[2] // ctx.k.shape[2]
    kh = ctx.k.to(F32).repeat_interleave(r, dim=2)                # [B, N, HV, dk]
    return G_last.exp()[..., None, None] * S0 + torch.einsum("bnh,bnhk,bnhv->bhkv", w, kh, ctx.u)


def gdn_path_recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    parents: torch.Tensor, initial_state: torch.Tensor, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The test oracle: plain sequential GDN decoding (float64) along each root→leaf path from S0.

    Every node lies on some root→leaf path, and its output and state there are those of decoding its own
    root→node path (a prefix). Returns ``o [B, N, HV, dv]`` and ``states [B, N, HV, dk, dv]`` (float64), the
    state after each node. Host loops over paths and tokens: for tests only.
    """
    B, N, HK, HV, r, dk, dv = check_gdn_tree_inputs(q, k, v, g, beta, parents, initial_state)
    scale = dk**-0.5 if scale is None else scale
    f64 = torch.float64
    qh = (q.cpu().to(f64) * scale).repeat_interleave(r, dim=2)    # [B, N, HV, dk]
    kh = k.cpu().to(f64).repeat_interleave(r, dim=2)
    vf, gf, bf = (t.cpu().to(f64) for t in (v, g, beta))
    o = torch.zeros(B, N, HV, dv, dtype=f64)
    states = torch.zeros(B, N, HV, dk, dv, dtype=f64)
    par = parents.long().cpu().tolist()
    for b in range(B):
        has_child = {p for p in par[b] if p >= 0}
        for leaf in (i for i in range(N) if i not in has_child):
            path = [leaf]
            while par[b][path[-1]] >= 0:
                path.append(par[b][path[-1]])
            S = initial_state[b].cpu().to(f64)
            for i in reversed(path):
                qi, ki, vi, gi, bi = (t[b, i] for t in (qh, kh, vf, gf, bf))
                S = S * gi.exp()[:, None, None]
                u = bi[:, None] * (vi - torch.einsum("hk,hkv->hv", ki, S))
                S = S + ki[:, :, None] * u[:, None, :]
                o[b, i] = torch.einsum("hk,hkv->hv", qi, S)
                states[b, i] = S
    return o, states
