"""Tree metadata for one verify step: tokens, parents, depths, positions, ancestor bitsets and conv taps.

A proposal tree has N nodes ordered so that every parent comes before its children; node 0 is the
root (the last sampled token, not yet in the target cache) and has parent −1. Everything the verify
kernels need about the tree's shape is the inclusive ancestor relation ``anc⁺(i)`` (ancestors and i),
kept as int64 bitsets ``[N, ceil(N/64)]``: bit j of row i is set iff j ∈ anc⁺(i), and, for the tree
conv, each node's three nearest ancestors. Both are built once per step on the device and shared by
every layer (tree attention, GDN solve, conv).

All helpers accept a leading batch dimension: parents ``[N]`` or ``[B, N]``.
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

import torch

TREE_SHAPES = ("chain", "star", "binary", "random", "best_first")


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Dense inclusive ancestor mask: ``mask[..., i, j]`` is True iff j ∈ anc⁺(i).

    ``parents [..., N]`` int (−1 for the root). Vectorised pointer doubling: ``ceil(log2 N)`` boolean
    matrix products, no host sync and no loop over nodes or depth. Returns bool ``[..., N, N]``.
    """
    n = parents.shape[-1]
    idx = torch.arange(n, device=parents.device)
    p = parents.long()
    # Reach within one step: self, and the parent (a root's parent −1 reaches nothing).
    step = (idx[:, None] == idx[None, :]) | (p[..., :, None] == idx)
    reach = step.to(torch.float32)
    for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
        reach = (reach @ reach).clamp_(max=1.0)  # paths of length ≤ 2^k; counts clamp to stay exact
    return reach > 0


def pack_bitsets(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask ``[..., N, N]`` into int64 bitsets ``[..., N, ceil(N/64)]`` (bit j%64 of word j//64)."""
    n = mask.shape[-1]
    words = -(-n // 64)
    padded = torch.nn.functional.pad(mask.long(), (0, words * 64 - n))
    bits = padded.reshape(*mask.shape[:-1], words, 64) << torch.arange(64, device=mask.device)
    return bits.sum(-1)  # int64 wraps mod 2^64, so bit 63 lands in the sign bit as intended


def unpack_bitsets(bits: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitsets`: int64 ``[..., N, W]`` → bool ``[..., N, n]``."""
    shifts = torch.arange(64, device=bits.device)
    mask = ((bits[..., :, None] >> shifts) & 1).bool()
    return mask.reshape(*bits.shape[:-1], -1)[..., :n]


def ancestor_bitsets(parents: torch.Tensor) -> torch.Tensor:
    """Inclusive ancestor bitsets ``[..., N, ceil(N/64)]`` int64 from ``parents [..., N]``."""
    return pack_bitsets(ancestor_mask(parents))


def validate_parents(parents: torch.Tensor, max_depth: int | None = None) -> None:
    """Raise ValueError unless ``parents [..., N]`` describes a topologically ordered tree rooted at 0.

    Checks: integer dtype, N ≥ 1, node 0 is the only root (parent −1), every other parent index is
    smaller than its child (this also rules out cycles), and depth ≤ ``max_depth`` if given. Syncs the host.
    """
    if parents.dtype.is_floating_point or parents.dtype == torch.bool:
        raise ValueError(f"parents must be an integer tensor, got {parents.dtype}")
    if parents.dim() not in (1, 2) or parents.shape[-1] < 1:
        raise ValueError(f"parents must be [N] or [B, N] with N >= 1, got {tuple(parents.shape)}")
    p = parents.long().reshape(-1, parents.shape[-1]).cpu()
    idx = torch.arange(p.shape[-1])
    if (p[:, 0] != -1).any():
        raise ValueError("node 0 must be the root (parent -1)")
    rest, rest_idx = p[:, 1:], idx[1:]
    if (rest < 0).any():
        bad = int(rest_idx[(rest < 0).any(0)][0])
        raise ValueError(f"node {bad} has no parent: the root must be node 0 and the only root")
    if (rest >= rest_idx).any():
        bad = int(rest_idx[(rest >= rest_idx).any(0)][0])
        raise ValueError(f"node {bad} has a parent at or after itself (not topologically ordered, or a cycle)")
    if max_depth is not None:
        depth = int(depths_from_parents(p).max())
        if depth > max_depth:
            raise ValueError(f"tree depth {depth} exceeds the limit {max_depth}")


def depths_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (root 0) as long ``[..., N]``: the number of proper ancestors."""
    return ancestor_mask(parents).sum(-1) - 1


def ancestor_chain(parents: torch.Tensor, start: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, M, length]`` indices ``a_0 = start, a_{t+1} = par(a_t)`` for ``parents [B, N]`` and ``start [B, M]``,
    continuing above the root as −1, −2, −3… (−s: s steps above the root, where the tree conv reads its
    committed window)."""
    chain = [start.long()]
    for _ in range(length - 1):
        a = chain[-1]
        up = parents.long().gather(1, a.clamp(min=0))
        chain.append(torch.where(a >= 0, up, a - 1))
    return torch.stack(chain, dim=-1)


def nearest_ancestors(parents: torch.Tensor, count: int = 3) -> torch.Tensor:
    """Each node's ``count`` nearest ancestors, nearest first, as int32 ``[..., N, count]`` (−1, −2, … above the
    root): the rows the width-4 tree conv reads besides the node's own. Built once per step (`TreeSpec`), the
    table lets the conv kernels load all taps at once instead of following parent pointers one dependent load
    at a time."""
    flat = parents.reshape(-1, parents.shape[-1])
    return ancestor_chain(flat, flat, count).to(torch.int32).reshape(*parents.shape, count)  # from the parent


@dataclass
class TreeSpec:
    """One verify step's tree, built once on the device and shared by all layers.

    ``tokens``, ``parents``, ``depths``, ``positions`` are ``[N]`` (or ``[B, N]``) long tensors;
    ``positions = cache_len + depth`` (RoPE positions); ``ancestors`` are the inclusive ancestor
    bitsets ``[..., N, ceil(N/64)]`` int64 read by every tree kernel; ``nearest_ancestors`` ``[..., N, 3]``
    int32 (`nearest_ancestors`) are the tree conv's taps above each node.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    positions: torch.Tensor
    ancestors: torch.Tensor
    nearest_ancestors: torch.Tensor

    @classmethod
    def build(cls, tokens: torch.Tensor, parents: torch.Tensor, cache_len: int | torch.Tensor = 0) -> TreeSpec:
        """Derive depths, positions, bitsets and the conv taps from ``tokens`` and ``parents`` (no host sync).

        ``cache_len`` is an int or a ``[B]`` tensor (committed length L of each sequence).
        """
        parents = parents.to(device=tokens.device, dtype=torch.long)
        mask = ancestor_mask(parents)
        depths = mask.sum(-1) - 1
        if isinstance(cache_len, torch.Tensor) and cache_len.dim() == 1:
            cache_len = cache_len.to(depths.device)[:, None]
        return cls(tokens.long(), parents, depths, depths + cache_len, pack_bitsets(mask), nearest_ancestors(parents))

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[-1]

    def ancestor_mask(self) -> torch.Tensor:
        """Dense bool ``[..., N, N]`` inclusive ancestor mask, for references and tests."""
        return unpack_bitsets(self.ancestors, self.num_nodes)

    def validate(self, max_depth: int | None = None) -> None:
        """Raise ValueError on malformed trees (see :func:`validate_parents`), mismatched shapes or
        duplicate sibling tokens (two children of one node with the same token). Syncs the host."""
        n = self.num_nodes
        for name in ("tokens", "depths", "positions"):
            if getattr(self, name).shape != self.parents.shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"expected {tuple(self.parents.shape)} like parents")
        words = -(-n // 64)
        if self.ancestors.shape != (*self.parents.shape, words) or self.ancestors.dtype != torch.int64:
            raise ValueError(f"ancestors must be int64 {(*self.parents.shape, words)}, "
                             f"got {self.ancestors.dtype} {tuple(self.ancestors.shape)}")
        if self.nearest_ancestors.shape != (*self.parents.shape, 3) or self.nearest_ancestors.dtype != torch.int32:
            raise ValueError(f"nearest_ancestors must be int32 {(*self.parents.shape, 3)}, got "
                             f"{self.nearest_ancestors.dtype} {tuple(self.nearest_ancestors.shape)}")
        validate_parents(self.parents, max_depth)
        tok = self.tokens.reshape(-1, n).cpu()
        par = self.parents.reshape(-1, n).cpu()
        for b in range(tok.shape[0]):
            pairs = torch.stack([par[b], tok[b]], dim=1)
            if torch.unique(pairs, dim=0).shape[0] != n:
                raise ValueError(f"duplicate sibling tokens in tree {b}: two children of one node share a token")


def random_parents(n: int, shape: str = "random", seed: int = 0, max_depth: int = 15) -> torch.Tensor:
    """Synthetic topologically ordered trees of ``n`` nodes for tests and benchmarks: ``[n]`` long.

    Shapes: ``chain``; ``star`` (all children of the root); ``binary`` (heap order); ``random`` (each
    node picks a uniformly random earlier parent); ``best_first`` (DDTree-like: a best-first expansion
    over per-depth top-k log-probabilities, depth ≤ ``max_depth``, so a deep spine with bushy tops).
    """
    rng = random.Random(seed)
    if shape == "chain":
        return torch.arange(n) - 1
    if shape == "star":
        return torch.tensor([-1] + [0] * (n - 1))
    if shape == "binary":
        return torch.tensor([-1] + [(i - 1) // 2 for i in range(1, n)])
    if shape == "random":
        return torch.tensor([-1] + [rng.randrange(i) for i in range(1, n)])
    if shape != "best_first":
        raise ValueError(f"unknown tree shape {shape!r}, expected one of {TREE_SHAPES}")
    # Child rank c of a node scores log p(c) with a peaked, slowly widening distribution per depth.
    logp = [[math.log(0.7 * 0.3**c + 1e-3 * rng.random()) for c in range(8)] for _ in range(max_depth + 1)]
    parents, depth = [-1], [0]
    frontier = [(-logp[1][0], 0, 0)]  # (−score, parent node, child rank)
    while len(parents) < n and frontier:
        neg, par, rank = heapq.heappop(frontier)
        node, d = len(parents), depth[par] + 1
        parents.append(par)
        depth.append(d)
        if rank + 1 < 8:  # the next sibling becomes available
            heapq.heappush(frontier, (neg + logp[d][rank] - logp[d][rank + 1], par, rank + 1))
        if d < max_depth:  # the first child of the new node
            heapq.heappush(frontier, (neg - logp[d + 1][0], node, 0))
    parents += [0] * (n - len(parents))  # only if the depth/width limits ran out of frontier
    return torch.tensor(parents)
