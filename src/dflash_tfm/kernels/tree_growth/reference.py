"""Pure-PyTorch twins of the tree-round kernels (``weaver_round.py``): they define what the kernels compute and
are what ``spec.weaver_tree`` runs off CUDA (its "torch" rounds)."""
from __future__ import annotations

import torch

LOGPROB_FLOOR = -1e30  # keeps real children finite, so only consumed/impossible entries are −inf


def weaver_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The Weaver's RMSNorm with weight and bias: statistics and affine in fp32, no mean subtraction, then x's
    dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float() + bias.float()).to(x.dtype)


def pool_logits_plus_residual(w_res: torch.Tensor, query: torch.Tensor, ids: torch.Tensor,
                              pool_logits: torch.Tensor) -> torch.Tensor:
    """``pool_logits + W_res[ids] · query`` fp32 ``[W, P]``: ids [W, P] long, pool_logits [W, P] fp32, query
    [W, D]; the residual is a bmm in W_res's dtype (fp32 accumulation, output rounded to that dtype)."""
    residual = torch.bmm(w_res[ids], query.to(w_res.dtype)[:, :, None]).squeeze(-1)
    return pool_logits.float() + residual.float()


def rescore_pool_reference(w_res: torch.Tensor, query: torch.Tensor, pool_ids: torch.Tensor,
                           pool_logits: torch.Tensor, depths: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    row = depths[nodes].clamp(max=pool_ids.shape[0] - 1)
    return pool_logits_plus_residual(w_res, query, pool_ids[row], pool_logits[row])


def publish_children_reference(logits: torch.Tensor, pool_ids: torch.Tensor, depths: torch.Tensor,
                               scores: torch.Tensor, frontier_score: torch.Tensor, frontier_token: torch.Tensor,
                               nodes: torch.Tensor) -> None:
    K, children = pool_ids.shape[0], frontier_score.shape[1]
    depth = depths[nodes]
    ids = pool_ids[depth.clamp(max=K - 1)]
    top, pick = logits.log_softmax(-1).clamp(min=LOGPROB_FLOOR).topk(children, dim=-1)
    frontier_score[nodes] = (scores[nodes, None] + top).masked_fill((depth >= K)[:, None], float("-inf"))
    frontier_token[nodes] = ids.gather(1, pick)


def place_nodes_reference(flat_score: torch.Tensor, flat_token: torch.Tensor, tokens: torch.Tensor,
                          parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                          ancestors: torch.Tensor, nodes: torch.Tensor, children: int) -> None:
    entry = flat_score.topk(nodes.shape[0]).indices  # best first
    parent = entry // children
    tokens[nodes] = flat_token[entry]
    parents[nodes] = parent
    scores[nodes] = flat_score[entry]
    depths[nodes] = depths[parent] + 1
    itself = torch.arange(ancestors.shape[1], device=nodes.device) == nodes[:, None]
    ancestors[nodes] = ancestors[parent] | itself  # (no Python-scalar setitem: that copies from the host)
    flat_score.index_fill_(0, entry, float("-inf"))
