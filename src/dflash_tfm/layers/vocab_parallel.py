"""The target's embedding and lm_head split by vocabulary rows across tensor-parallel ranks (Megatron's
vocab-parallel layers), used by the target, the drafter and the Weaver alike.

A rank holds rows [rank · V/tp, (rank + 1) · V/tp) of each (`parallel.sharding.vocab_rows`; a weight with all V
rows is replicated and these functions are the plain lookup and projection). A lookup reads the ids in the
rank's rows, zeroes the others and all-reduces: each sum adds one row and zeros, so the result equals the
replicated lookup bit for bit. The lm_head projects onto the rank's rows and all-gathers the logits, so every
rank holds the full fp32 logits and draws the same tokens. The memory saved per rank is (1 − 1/tp) of both
tables (Qwen3.5-397B: 2 × 248,320 × 4,096 in bf16, 4.1 GB, of which 3.6 GB at tp 8).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_tfm.layers.linear import linear
from dflash_tfm.parallel.group import all_gather, all_reduce, tp_rank


def vocab_embedding(ids: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`F.embedding(ids, full table)` from this rank's rows of the table (`weight` [V or V/tp, H])."""
    rows = weight.shape[0]
    if rows == vocab_size:
        return F.embedding(ids, weight)
    local = ids - tp_rank() * rows
    inside = (local >= 0) & (local < rows)
    h = F.embedding(local.clamp(0, rows - 1), weight) * inside.unsqueeze(-1).to(weight.dtype)
    return all_reduce(h)


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 logits [..., V] of hidden [..., H] through the lm_head whose rows this rank holds (`weight`); the
    ranks' parts are gathered in the model dtype (half the bytes of fp32 for bf16) and widened after."""
    logits = linear(hidden, weight)
    return (logits if weight.shape[0] == vocab_size else all_gather(logits, dim=-1)).float()


def gather_vocab_rows(table: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A per-token table [V/tp, d] computed from this rank's rows -> the full [V, d] on every rank (the Weaver's
    tables, read at arbitrary candidate ids)."""
    return table if table.shape[0] == vocab_size else all_gather(table, dim=0)
