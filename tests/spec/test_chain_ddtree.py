"""DFLASH chain and DDTREE proposal builders against plain Python oracles (classic best-first heap)."""
from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch

from dflash_tfm.spec.chain import build_chain
from dflash_tfm.spec.ddtree import build_ddtree
from dflash_tfm.tree import TreeSpec, depths_from_parents

from .test_weaver import single_thread  # noqa: F401 (autouse: one intra-op thread in this module)

K = 15


def heap_ddtree(root: int, logits: torch.Tensor, budget: int) -> tuple[list[int], list[int], list[int]]:
    """Classic best-first heap: pop the best entry; push its next-ranked sibling and its first child.

    Scores are accumulated in float32 exactly like the builder (parent score + log-prob), so without ties the
    pop order is the builder's output order. Ties would go to the entry pushed first.
    """
    lp = torch.log_softmax(logits.float(), -1)
    vals, ids = lp.sort(-1, descending=True)
    vals, ids = vals.numpy(), ids.tolist()
    depth_limit, vocab = lp.shape
    tokens, parents, depths, scores = [root], [-1], [0], [np.float32(0.0)]
    heap, pushed = [], 0

    def push(score: np.float32, parent: int, depth: int, rank: int) -> None:
        nonlocal pushed
        heapq.heappush(heap, (-float(score), pushed, parent, depth, rank, score))
        pushed += 1

    push(np.float32(scores[0] + vals[0, 0]), 0, 1, 0)
    while len(tokens) < budget + 1:
        _, _, parent, depth, rank, score = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(score)
        if rank + 1 < vocab:
            push(np.float32(scores[parent] + vals[depth - 1, rank + 1]), parent, depth, rank + 1)
        if depth < depth_limit:
            push(np.float32(score + vals[depth, 0]), node, depth + 1, 0)
    return tokens, parents, depths


def check_tree(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, n: int, root: int) -> None:
    """Static size, node 0 = root, parents before children, distinct siblings, depth ≤ K, consistent depths."""
    for t in (tokens, parents, depths):
        assert t.shape == (n,) and t.dtype == torch.long
    assert tokens[0].item() == root and parents[0].item() == -1
    TreeSpec.build(tokens, parents).validate(max_depth=K)
    assert torch.equal(depths, depths_from_parents(parents))


@pytest.mark.parametrize("root_shape", [(), (1,)])
def test_chain_is_root_plus_argmax(root_shape: tuple[int, ...]) -> None:
    logits = torch.randn(K, 97, generator=torch.Generator().manual_seed(1))
    tokens, parents, depths = build_chain(torch.full(root_shape, 7), logits)
    assert tokens.tolist() == [7] + logits.argmax(-1).tolist()
    assert parents.tolist() == list(range(-1, K)) and depths.tolist() == list(range(K + 1))
    check_tree(tokens, parents, depths, K + 1, 7)


@pytest.mark.parametrize("vocab", [3, 50, 1000])
@pytest.mark.parametrize("budget", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("seed", range(3))
def test_ddtree_equals_heap_oracle(vocab: int, budget: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    scale = [0.5, 2.0, 5.0][seed]  # flat to peaked marginals: bushy to deep trees
    logits = torch.randn(K, vocab, generator=gen) * scale
    root = int(torch.randint(vocab, (), generator=gen))
    tokens, parents, depths = build_ddtree(torch.tensor(root), logits, budget)
    check_tree(tokens, parents, depths, budget + 1, root)
    want = heap_ddtree(root, logits, budget)
    assert (tokens.tolist(), parents.tolist(), depths.tolist()) == want


def test_ddtree_ties_and_masked_vocab_keep_a_valid_tree() -> None:
    """One-hot marginals give log-probs of exactly 0 (children tie with parents); −inf logits are real but
    last-choice candidates. Whatever the tie order, the tree must stay well formed."""
    logits = torch.full((K, 40), float("-inf"))
    logits[:, :3] = torch.tensor([60.0, 0.0, 0.0])  # top token has log-prob 0.0 in fp32; two tied runners-up
    for budget in (8, 64, 200):
        tokens, parents, depths = build_ddtree(torch.tensor([5]), logits, budget)
        check_tree(tokens, parents, depths, budget + 1, 5)
    tokens, parents, depths = build_ddtree(torch.tensor(5), logits, K)
    assert parents.tolist() == list(range(-1, K)) and tokens[1:].tolist() == [0] * K  # the log-prob-0 spine


def test_ddtree_rejects_impossible_budget() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        build_ddtree(torch.tensor(0), torch.zeros(K, 1), K + 1)


@pytest.mark.parametrize("budget", [1, 16, 64])
def test_a_batch_of_rows_builds_each_row_s_own_tree(budget: int) -> None:
    """Leading dims build one tree per row in the same launches: each equal to that row built alone (ties
    included: a row of equal logits and a row with masked tokens sit beside random rows)."""
    torch.manual_seed(budget)
    logits = torch.randn(4, K, 50) * 3
    logits[1] = 0.0
    logits[2, :, 10:] = float("-inf")
    roots = torch.tensor([3, 4, 5, 6])
    for build in (lambda r, lg: build_ddtree(r, lg, budget), build_chain):
        batched = build(roots, logits)
        for r in range(4):
            assert all(torch.equal(b[r], a) for b, a in zip(batched, build(roots[r], logits[r])))
