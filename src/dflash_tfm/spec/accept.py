"""Lossless acceptance of a verified proposal tree (target-only tree sampling, KERNELS.md).

At node n the target's token x_n is drawn from p_n (argmax when greedy); if a child of n carries x_n we
descend, else x_n is the bonus token and the step ends. Every visited node's draw is a fresh draw from the
target, so the emitted sequence is distributed exactly as plain target sampling whatever the tree is.
Draws are made for all nodes at once (unvisited ones are simply ignored) so the walk is a few tensor ops
with no host synchronisation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_tfm.sampling import processed_probs
from dflash_tfm.sampling_params import SamplingParams


@dataclass
class Acceptance:
    """accepted [..., N] bool (root included); path [..., max_depth + 1] node indices root first, -1 padded;
    last: the deepest accepted node [...]; bonus: the target's token drawn there [...] (no leading dims: one
    tree)."""

    accepted: torch.Tensor
    path: torch.Tensor
    last: torch.Tensor
    bonus: torch.Tensor

    def only(self, rows: torch.Tensor) -> "Acceptance":
        """This acceptance with the trees where ``rows`` [...] bool is False accepting nothing, not even the root:
        a commit of it leaves their caches and states as they were (a batch row still in its prompt)."""
        return Acceptance(self.accepted & rows.unsqueeze(-1), torch.where(rows.unsqueeze(-1), self.path, -1),
                          self.last, self.bonus)

    def path_or_last(self) -> torch.Tensor:
        """`path` with its padding replaced by the last accepted node: a node for every slot, so gathering the
        path's features fills the slots past it with scratch that the next commit overwrites."""
        return torch.where(self.path >= 0, self.path, self.last.unsqueeze(-1))

    def emitted(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens the step produces, per tree: the accepted drafts (path below the root) then the bonus,
        -1 padded; [..., max_depth + 1] like `path`, from the trees' tokens [..., N]."""
        after = torch.cat([self.path[..., 1:], torch.full_like(self.path[..., :1], -1)], dim=-1)  # next path node
        drafts = torch.where(after >= 0, tokens.gather(-1, after.clamp(min=0)), -1)
        last_slot = (self.path >= 0).sum(-1, keepdim=True) - 1
        slots = torch.arange(self.path.shape[-1], device=self.path.device)
        return torch.where(slots == last_slot, self.bonus.unsqueeze(-1), drafts)


def target_draws(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    """One target token per node: logits [N, V] fp32 -> [N]: the argmax if greedy, else an exact sample of p_n
    by inversion of its CDF at uniforms[n] (uniforms [>= N] in [0, 1), drawn by the caller from the request's
    generator, so this function has no RNG of its own and can sit inside a CUDA graph)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    cdf = processed_probs(logits, params).cumsum(-1)
    total = cdf[:, -1:]
    picked = torch.searchsorted(cdf, uniforms[: cdf.shape[0], None] * total, right=True)  # first cdf > u·total
    last_positive = (cdf < total).sum(-1, keepdim=True)  # where the CDF reaches its total: p > 0 there
    return torch.minimum(picked, last_positive).squeeze(-1)


def accept_tree(
    tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
    draws: torch.Tensor, max_depth: int,
) -> Acceptance:
    """Walk the tree along the target's draws.

    tokens, parents, depths, draws [..., N]; ancestors [..., N, N] bool inclusive ancestor mask (leading dims: a
    batch of trees, walked independently). Siblings carry distinct tokens, so at most one child matches a draw
    and the accepted nodes form a root path.
    """
    N = tokens.shape[-1]
    parent_draw = draws.gather(-1, parents.clamp(min=0))
    match = (tokens == parent_draw) | (parents < 0)
    accepted = ~(ancestors & ~match.unsqueeze(-2)).any(dim=-1)
    last = torch.where(accepted, depths, torch.full_like(depths, -1)).argmax(dim=-1)
    slot = torch.where(accepted, depths, torch.full_like(depths, max_depth + 1))
    path = torch.full((*tokens.shape[:-1], max_depth + 2), -1, dtype=torch.long, device=tokens.device)
    path.scatter_(-1, slot, torch.arange(N, device=tokens.device).expand_as(slot))
    bonus = draws.gather(-1, last.unsqueeze(-1)).squeeze(-1)  # (indexing with a 0-dim tensor would sync the host)
    return Acceptance(accepted=accepted, path=path[..., : max_depth + 1], last=last, bonus=bonus)


def expected_accepted(
    logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
    params: SamplingParams,
) -> torch.Tensor:
    """The exact expected number of drafts ``accept_tree`` accepts on this verified tree (0-dim fp32).

    A node is accepted iff every draw along root→node matches, and the draws are independent: so the
    expectation is Σ over non-root nodes of Π p_parent(token) along the path (p = ``processed_probs``, or the
    argmax indicator when greedy). Used to compare tree builders on the same states without sampling noise.
    """
    if params.greedy:
        probs = torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    else:
        probs = processed_probs(logits, params)
    edge = probs[parents.clamp(min=0), tokens].double()  # p of each node's token at its parent
    edge = torch.where(parents < 0, torch.ones_like(edge), edge)
    path = torch.where(ancestors, edge.unsqueeze(0), torch.ones_like(edge).unsqueeze(0)).prod(-1)
    return (path.sum() - 1.0).float()  # the root's empty product counts 1
