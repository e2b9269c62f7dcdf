"""TreeSpec: ancestor masks and bitsets agree with walking the parent pointers; malformed trees are rejected."""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.tree import (
    TREE_SHAPES,
    TreeSpec,
    ancestor_bitsets,
    ancestor_mask,
    depths_from_parents,
    nearest_ancestors,
    pack_bitsets,
    random_parents,
    unpack_bitsets,
    validate_parents,
)

from .test_tree_common import root_path


@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("N", [1, 2, 63, 64, 65, 129])
def test_ancestor_mask_and_bitsets_match_parent_walk(shape: str, N: int) -> None:
    parents = torch.stack([random_parents(N, shape, seed=s) for s in range(2)])
    validate_parents(parents, max_depth=None)
    mask = ancestor_mask(parents)
    expect = torch.zeros(2, N, N, dtype=torch.bool)
    for b in range(2):
        for i in range(N):
            expect[b, i, root_path(parents[b], i)] = True
    assert torch.equal(mask, expect)
    bits = ancestor_bitsets(parents)
    assert bits.dtype == torch.int64 and bits.shape == (2, N, -(-N // 64))
    assert torch.equal(unpack_bitsets(bits, N), expect)
    assert torch.equal(depths_from_parents(parents), expect.sum(-1) - 1)


@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("N", [1, 2, 5, 65])
def test_nearest_ancestors_match_parent_walk(shape: str, N: int) -> None:
    """Row i: the 1st, 2nd, 3rd node up from i, continuing above the root as −1, −2, −3; [N] or [B, N]."""
    parents = torch.stack([random_parents(N, shape, seed=s) for s in range(2)])
    expect = torch.empty(2, N, 3, dtype=torch.int32)
    for b in range(2):
        for i in range(N):
            above = root_path(parents[b], i)[::-1][1:]  # i's parent, …, the root
            expect[b, i] = torch.tensor((above + [-1, -2, -3])[:3])
    assert torch.equal(nearest_ancestors(parents), expect)
    assert torch.equal(nearest_ancestors(parents[1]), expect[1])


def test_bitset_word_layout() -> None:
    """Bit j % 64 of word j // 64, bit 63 being the sign bit of the int64 word."""
    mask = torch.zeros(1, 130, dtype=torch.bool)
    mask[0, [0, 63, 64, 129]] = True
    bits = pack_bitsets(mask)
    assert bits.tolist() == [[1 - 2**63, 1, 2]]


def test_best_first_trees_are_bushy_and_shallow() -> None:
    parents = random_parents(65, "best_first", max_depth=15)
    depths = depths_from_parents(parents)
    assert int(depths.max()) <= 15 and int((parents == 0).sum()) >= 2


def test_tree_spec_build_batch_and_positions() -> None:
    parents = torch.stack([random_parents(9, "binary"), random_parents(9, "chain")])
    tokens = torch.arange(18).reshape(2, 9)
    spec = TreeSpec.build(tokens, parents, cache_len=torch.tensor([5, 100]))
    spec.validate(max_depth=8)
    assert spec.num_nodes == 9
    assert spec.depths[0].tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3]
    assert spec.positions[1].tolist() == list(range(100, 109))
    assert torch.equal(spec.ancestor_mask(), ancestor_mask(parents))
    assert torch.equal(spec.nearest_ancestors, nearest_ancestors(parents))
    assert TreeSpec.build(tokens[0], parents[0], cache_len=7).positions.tolist() == [7, 8, 8, 9, 9, 9, 9, 10, 10]


@pytest.mark.parametrize("parents, match", [
    ([0, 0, 1], "node 0 must be the root"),
    ([-1, 0, -1], "no parent"),
    ([-1, 2, 0], "at or after itself"),
    ([-1, 1, 1], "at or after itself"),
])
def test_validate_rejects_malformed_parents(parents: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_parents(torch.tensor(parents))


def test_validate_rejects_depth_shapes_dtypes_and_duplicate_siblings() -> None:
    with pytest.raises(ValueError, match="exceeds the limit 3"):
        validate_parents(random_parents(6, "chain"), max_depth=3)
    with pytest.raises(ValueError, match="integer"):
        validate_parents(torch.tensor([-1.0, 0.0]))
    with pytest.raises(ValueError, match=r"\[N\] or \[B, N\]"):
        validate_parents(torch.zeros(1, 1, 3, dtype=torch.long))
    parents = torch.tensor([-1, 0, 0, 1])
    with pytest.raises(ValueError, match="duplicate sibling"):
        TreeSpec.build(torch.tensor([5, 7, 7, 7]), parents).validate()
    TreeSpec.build(torch.tensor([5, 7, 8, 7]), parents).validate()  # same token under different parents is fine
    spec = TreeSpec.build(torch.tensor([5, 7, 8, 7]), parents)
    spec.tokens = spec.tokens[:3]
    with pytest.raises(ValueError, match="tokens has shape"):
        spec.validate()
    spec = TreeSpec.build(torch.tensor([5, 7, 8, 7]), parents)
    spec.nearest_ancestors = spec.nearest_ancestors.long()
    with pytest.raises(ValueError, match="nearest_ancestors must be int32"):
        spec.validate()
