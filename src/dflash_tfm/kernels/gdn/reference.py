"""Pure-PyTorch Gated DeltaNet (GDN): the definition every GDN kernel is tested against.

Per value head, with fp32 state ``S [dk, dv]`` and one token ``(q, k, v, g, β)``::

    S ← e^g S;   u = β (v − Sᵀk);   S ← S + k uᵀ;   o = Sᵀ (q · scale)

Shapes (shared by all GDN kernels): ``q, k [B, T, HK, dk]`` already L2-normalised; ``v [B, T, HV, dv]``
with grouped values (``HV = r·HK``, value head ``j`` reads q/k head ``j // r``); ``g`` (log decay, ≤ 0) and
``β`` ``[B, T, HV]``; state ``[B, HV, dk, dv]`` fp32. ``scale`` defaults to ``dk**-0.5``.

``gdn_inputs`` is everything between a layer's input projection and the recurrence (split, short conv, SiLU,
l2norm, β, g). ``gdn_recurrent_reference`` is the token-by-token definition. ``gdn_chunk_reference`` is the chunked
(WY / UT-transform) form, exact in fp32 and fast enough to be the engine's CPU prefill path. Neither
function modifies its inputs; both return ``o`` in ``v``'s dtype and the final state in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_tfm.kernels.conv.reference import causal_conv1d

F32 = torch.float32


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x * rsqrt(sum x^2 + eps)` in fp32, the form transformers and fla use."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def split_projection(
    proj: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, conv_dim: int, hv: int, dv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """in_proj output [B, T, *] -> (conv input [B, T, conv_dim], z [B, T, HV, dv], beta, g [B, T, HV] fp32)."""
    B, T, _ = proj.shape
    mixed, z, b, a = proj.split([conv_dim, hv * dv, hv, hv], dim=-1)
    beta = torch.sigmoid(b).float()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return mixed, z.reshape(B, T, hv, dv), beta, g


def split_heads(conv_out: torch.Tensor, hk: int, dk: int, hv: int, dv: int) -> tuple[torch.Tensor, ...]:
    """conv output [B, T, conv_dim] -> q, k [B, T, HK, dk] (L2-normalised) and v [B, T, HV, dv]."""
    B, T, _ = conv_out.shape
    q, k, v = conv_out.split([hk * dk, hk * dk, hv * dv], dim=-1)
    dtype = conv_out.dtype
    q = l2_normalize(q.reshape(B, T, hk, dk)).to(dtype)
    k = l2_normalize(k.reshape(B, T, hk, dk)).to(dtype)
    return q, k, v.reshape(B, T, hv, dv)


def gdn_inputs(
    proj: torch.Tensor, conv_weight: torch.Tensor, conv_window: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, hk: int, dk: int, hv: int, dv: int,
) -> tuple[torch.Tensor, ...]:
    """in_proj output -> (q, k, v, z, beta, g, new conv window) for T tokens following `conv_window`."""
    mixed, z, beta, g = split_projection(proj, A_log, dt_bias, 2 * hk * dk + hv * dv, hv, dv)
    conv_out, new_window = causal_conv1d(mixed, conv_weight, conv_window)
    q, k, v = split_heads(conv_out, hk, dk, hv, dv)
    return q, k, v, z, beta, g, new_window


def gdn_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[int, int, int, int, int, int]:
    """Validate GDN input shapes and return ``(B, T, HK, r, dk, dv)`` with ``r = HV // HK``."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, HK, dk] of equal shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    B, T, HK, dk = q.shape
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T) or v.shape[2] % HK != 0:
        raise ValueError(f"v must be [B, T, HV, dv] with HV a multiple of HK={HK}, got {tuple(v.shape)}")
    HV, dv = v.shape[2], v.shape[3]
    if tuple(g.shape) != (B, T, HV) or tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"g and beta must be [B, T, HV]=[{B}, {T}, {HV}], got {tuple(g.shape)}, {tuple(beta.shape)}")
    return B, T, HK, HV // HK, dk, dv


def _initial_state(
    initial_state: torch.Tensor | None, B: int, HK: int, r: int, dk: int, dv: int, device: torch.device
) -> torch.Tensor:
    """fp32 copy of the initial state viewed per key head: ``[B, HK, r, dk, dv]``."""
    if initial_state is None:
        return torch.zeros(B, HK, r, dk, dv, dtype=F32, device=device)
    if tuple(initial_state.shape) != (B, HK * r, dk, dv):
        raise ValueError(f"initial_state must be [{B}, {HK * r}, {dk}, {dv}], got {tuple(initial_state.shape)}")
    return initial_state.to(F32, copy=True).reshape(B, HK, r, dk, dv)


def gdn_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token GDN recurrence in fp32 (vectorised over batch and heads).

    Returns ``o [B, T, HV, dv]`` in ``v.dtype`` and the final state ``[B, HV, dk, dv]`` fp32.
    """
    B, T, HK, r, dk, dv = gdn_shapes(q, k, v, g, beta)
    scale = dk**-0.5 if scale is None else scale
    qf = q.to(F32) * scale                                  # [B, T, HK, dk]
    kf = k.to(F32)
    vf = v.to(F32).reshape(B, T, HK, r, dv)
    decay = g.to(F32).exp().reshape(B, T, HK, r, 1, 1)
    bf = beta.to(F32).reshape(B, T, HK, r, 1)
    S = _initial_state(initial_state, B, HK, r, dk, dv, q.device)  # [B, HK, r, dk, dv]
    o = torch.empty(B, T, HK, r, dv, dtype=F32, device=q.device)
    for t in range(T):
        kt = kf[:, t]
        S = S * decay[:, t]
        u = bf[:, t] * (vf[:, t] - torch.einsum("bhk,bhrkv->bhrv", kt, S))
        S = S + kt[:, :, None, :, None] * u[:, :, :, None, :]
        o[:, t] = torch.einsum("bhk,bhrkv->bhrv", qf[:, t], S)
    return o.reshape(B, T, HK * r, dv).to(v.dtype), S.reshape(B, HK * r, dk, dv)


def gdn_chunk_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT-transform) GDN in fp32: parallel inside chunks, a short scan over chunks.

    Within a chunk (cumulative log decay ``G``, start state ``S0``) the recurrence unrolls to
    ``(I + A) U = diag(β)(V − diag(e^G) K S0)`` with ``A_ij = β_i e^(G_i−G_j) k_i·k_j`` (j < i),
    ``O = diag(e^G) Q S0 + (QKᵀ ∘ D) U`` with ``D_ij = e^(G_i−G_j)`` (j ≤ i), and
    ``S1 = e^(G_last) S0 + Kᵀ diag(e^(G_last−G)) U``. ``U = W1 − W2 S0`` where ``W1, W2`` use ``(I + A)⁻¹``
    from one batched triangular solve over all chunks; Gram matrices are computed once per key head.
    Only differences ``G_i − G_j`` with ``j ≤ i`` are exponentiated, so nothing overflows.

    Returns ``o [B, T, HV, dv]`` in ``v.dtype`` and the final state ``[B, HV, dk, dv]`` fp32.
    """
    B, T, HK, r, dk, dv = gdn_shapes(q, k, v, g, beta)
    scale = dk**-0.5 if scale is None else scale
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    # Zero padding is inert: k = v = β = 0 and g = 0 leave the state and the real outputs unchanged.
    # Chunk index first, so that each scan step reads contiguous blocks.
    qc = F.pad(q.to(F32) * scale, (0, 0, 0, 0, 0, pad)).reshape(B, N, C, HK, dk).permute(1, 0, 3, 2, 4)
    kc = F.pad(k.to(F32), (0, 0, 0, 0, 0, pad)).reshape(B, N, C, HK, dk).permute(1, 0, 3, 2, 4)
    vc = F.pad(v.to(F32), (0, 0, 0, 0, 0, pad)).reshape(B, N, C, HK, r, dv).permute(1, 0, 3, 4, 2, 5)
    gc = F.pad(g.to(F32), (0, 0, 0, pad)).reshape(B, N, C, HK, r).permute(1, 0, 3, 4, 2)
    bc = F.pad(beta.to(F32), (0, 0, 0, pad)).reshape(B, N, C, HK, r).permute(1, 0, 3, 4, 2)
    # qc, kc: [N, B, HK, C, dk]; vc: [N, B, HK, r, C, dv]; gc, bc: [N, B, HK, r, C]

    G = gc.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [N, B, HK, r, C, C]
    kk = kc.unsqueeze(3)                                                               # [N, B, HK, 1, C, dk]
    A = bc[..., None] * (kk @ kk.transpose(-1, -2)) * D  # Gram per key head; diagonal ignored below
    # (I + A)⁻¹ then two matmuls: ~10x faster on CPU than a triangular solve with dv + dk right-hand sides.
    eye = torch.eye(C, dtype=F32, device=q.device)
    inv = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
    W1 = inv @ (bc[..., None] * vc)                                   # [N, B, HK, r, C, dv]
    W2 = inv @ ((bc * G.exp())[..., None] * kk)                       # [N, B, HK, r, C, dk]
    P = (qc.unsqueeze(3) @ kk.transpose(-1, -2)) * D                  # intra-chunk output weights
    Qd = qc.unsqueeze(3) * G.exp()[..., None]                         # queries decayed from chunk start
    Kd = (kk * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2)  # keys decayed to chunk end, [.., dk, C]
    chunk_decay = G[..., -1].exp()[..., None, None]                   # [N, B, HK, r, 1, 1]
    del D, A, inv

    S = _initial_state(initial_state, B, HK, r, dk, dv, q.device)     # [B, HK, r, dk, dv]
    o = torch.empty(B, N * C, HK, r, dv, dtype=F32, device=q.device)
    for n in range(N):
        U = W1[n] - W2[n] @ S                                         # [B, HK, r, C, dv]
        o[:, n * C:(n + 1) * C] = (torch.matmul(Qd[n], S).add_(P[n] @ U)).permute(0, 3, 1, 2, 4)
        S = S.mul_(chunk_decay[n]).add_(Kd[n] @ U)                    # S is our own copy
    o = o[:, :T].reshape(B, T, HK * r, dv)
    return o.to(v.dtype), S.reshape(B, HK * r, dk, dv)


def make_gdn_inputs(
    B: int,
    T: int,
    HK: int,
    HV: int,
    dk: int,
    dv: int,
    dtype: torch.dtype = F32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random model-like GDN inputs for tests and benchmarks: unit q/k, β ∈ (0, 1), g ≤ 0, fp32 state.

    Returns ``dict(q, k, v, g, beta, initial_state)``; q/k/v in ``dtype``, g and β fp32 (as the model makes them).
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F32)

    q = F.normalize(randn(B, T, HK, dk), dim=-1)
    k = F.normalize(randn(B, T, HK, dk), dim=-1)
    inputs = {
        "q": q,
        "k": k,
        "v": randn(B, T, HV, dv),
        "g": F.logsigmoid(randn(B, T, HV) + 2.0),
        "beta": torch.rand(B, T, HV, generator=gen).clamp(0.01, 0.99),
        "initial_state": 0.5 * randn(B, HV, dk, dv),
    }
    low = ("q", "k", "v")
    return {name: x.to(device=device, dtype=dtype if name in low else F32) for name, x in inputs.items()}
