"""Pure-PyTorch twins of the tree causal conv1d kernels (width 4, depthwise, SiLU), and the plain causal conv of
prefill and decode (`causal_conv1d`).

Node i's conv input window is its own input and those of its 3 nearest ancestors; positions above the root
read the committed window ``c0`` (most recent last), so every node sees exactly what plain causal conv
over its root→node path, preceded by ``c0``, would see. HF convention: weight ``[C, 4]`` (``[C, 1, 4]``
squeezed), output at t = Σ_s w[:, s] · x[t − 3 + s].

Shapes: x ``[B, N, C]``, weight ``[C, 4]``, parents ``[B, N]`` (−1 for the root), conv_window ``[B, C, 3]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_tfm.tree import ancestor_chain

WIDTH = 4


def check_tree_conv_inputs(
    x: torch.Tensor, parents: torch.Tensor, conv_window: torch.Tensor, shared_trees: bool = False,
) -> tuple[int, int, int]:
    """Validate shapes (no host sync) and return ``(B, N, C)``. ``shared_trees``: parents may have P rows with
    B a multiple of P (row b follows tree b % P)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, N, C], got {tuple(x.shape)}")
    B, N, C = x.shape
    P = B
    if shared_trees and parents.dim() == 2 and parents.shape[0] and B % parents.shape[0] == 0:
        P = parents.shape[0]
    if tuple(parents.shape) != (P, N):
        raise ValueError(f"parents must be [{B}, {N}]" + (" (or [P, N], P dividing the batch)" if shared_trees else "")
                         + f", got {tuple(parents.shape)}")
    if tuple(conv_window.shape) != (B, C, WIDTH - 1):
        raise ValueError(f"conv_window must be [{B}, {C}, {WIDTH - 1}], got {tuple(conv_window.shape)}")
    return B, N, C


def _gather_inputs(x: torch.Tensor, conv_window: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
    """Inputs at chain indices ``[B, M, T]`` → ``[B, M, T, C]`` fp32 (tree rows or window slots)."""
    B, M, T = chain.shape
    flat = chain.reshape(B, M * T)
    tree = x.float().gather(1, flat.clamp(min=0)[..., None].expand(-1, -1, x.shape[-1]))
    slot = (WIDTH - 1 + flat).clamp(0, WIDTH - 2)  # −1 → 2 (most recent), −2 → 1, −3 → 0
    window = conv_window.float().transpose(1, 2).gather(1, slot[..., None].expand(-1, -1, x.shape[-1]))
    return torch.where((flat >= 0)[..., None], tree, window).reshape(B, M, T, -1)


def tree_causal_conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, parents: torch.Tensor, conv_window: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Tree conv in fp32: ``y_i = act(Σ_t w[:, 3−t] · x_{anc_t(i)})``. Returns ``y [B, N, C]`` in x's dtype."""
    B, N, C = check_tree_conv_inputs(x, parents, conv_window)
    nodes = torch.arange(N, device=x.device).expand(B, N)
    inputs = _gather_inputs(x, conv_window, ancestor_chain(parents, nodes, WIDTH))  # [B, N, 4, C], t = 0 is self
    y = torch.einsum("bntc,ct->bnc", inputs, weight.float().flip(-1))
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return y.to(x.dtype)


def tree_conv_commit_reference(
    x: torch.Tensor, parents: torch.Tensor, accepted: torch.Tensor, conv_window: torch.Tensor
) -> torch.Tensor:
    """New window ``[B, C, 3]``: the last 3 conv inputs along the accepted path (root included), falling
    back into the old window when the path is shorter. Nothing accepted keeps the old window."""
    check_tree_conv_inputs(x, parents, conv_window)
    idx = torch.arange(x.shape[1], device=x.device)
    last = torch.where(accepted.bool(), idx, -1).amax(-1)                  # deepest accepted node, [B]
    chain = ancestor_chain(parents, last[:, None], WIDTH - 1)              # [B, 1, 3], most recent first
    inputs = _gather_inputs(x, conv_window, chain)[:, 0]                   # [B, 3, C]
    return inputs.flip(1).transpose(1, 2).to(conv_window.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C], weight [C, K], window [B, C, K-1] (oldest first) -> (silu(conv) [B, T, C], new window).

    y_t = silu(sum_s weight[:, s] * x_{t-K+1+s}) with fp32 accumulation (like cuDNN's conv1d); inputs
    before the first token come from `window`, so prefill (zero window) and decode share one code path.
    Written as unfold + weighted sum so inductor fuses it with its neighbours.
    """
    K = weight.shape[1]
    T = x.shape[1]
    xs = torch.cat((window.to(x.dtype), x.transpose(1, 2)), dim=-1)  # [B, C, K-1+T]
    y = (xs.float().unfold(-1, K, 1) * weight.float().unsqueeze(1)).sum(-1)  # [B, C, T]
    return F.silu(y).to(x.dtype).transpose(1, 2), xs[:, :, T:]
