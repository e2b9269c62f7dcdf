"""Tree causal conv1d: every node equals plain causal-conv decoding of its root→node path from the window.

Oracle: transformers' ``causal_conv1d_update`` (the model's one-token decode step, torch version) applied
token by token along the path, starting from the committed window; the commit must equal the window that
decoding leaves behind. Triton kernels: see test_tree_common for how they run on the CPU.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from dflash_tfm.kernels import TRITON_INTERPRETED, tree_causal_conv1d, tree_conv_commit
from dflash_tfm.kernels.conv.reference import tree_causal_conv1d_reference, tree_conv_commit_reference
from dflash_tfm.tree import TREE_SHAPES, nearest_ancestors, random_parents

from .test_tree_common import accepted_mask, rel_err, root_path, triton_device  # noqa: F401  (fixture)


def hf_conv_update():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.causal_conv1d_update)


def decode_path(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, path: list[int]):
    """Plain decoding of x[path] ([C] rows) from window [C, 3]: outputs {node: [C]} and the final window."""
    update = hf_conv_update()
    state = window[None].double().clone()
    ys = {i: update(x[i].double()[None, :, None], state, weight.double(), None, "silu")[0, :, 0] for i in path}
    return ys, state[0]


def make_case(B: int, N: int, C: int, shape: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(N + C)
    parents = torch.stack([random_parents(N, shape, seed=b) for b in range(B)])
    x, w = torch.randn(B, N, C, generator=gen), torch.randn(C, 4, generator=gen)
    win = torch.randn(B, C, 3, generator=gen)
    return (t.to(device=device, dtype=dtype) for t in (x, w, win)), parents


def check(conv, commit, B: int, N: int, C: int, shape: str, device: str = "cpu") -> None:
    (x, w, win), parents = make_case(B, N, C, shape, device)
    win_before = win.clone()
    y = conv(x, w, parents.to(device), win)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.equal(win, win_before)
    for b in range(B):  # decoding each root→leaf path gives every node on it (its root→node prefix)
        leaves = set(range(N)) - set(parents[b].tolist())
        for leaf in leaves:
            ys, _ = decode_path(x[b].cpu(), w.cpu(), win[b].cpu(), root_path(parents[b], leaf))
            for i, expect in ys.items():
                assert rel_err(y[b, i], expect) <= 1e-5, (b, i)
    # commits: paths of length 1, 2, ≥ 3 and none
    gen = torch.Generator().manual_seed(N)
    for nodes in ([0] * B, [min(1, N - 1)] * B, torch.randint(0, N, (B,), generator=gen).tolist(), [-1] * B):
        new = commit(x, parents.to(device), accepted_mask(parents, nodes).to(device), win)
        for b, node in enumerate(nodes):
            path = root_path(parents[b], node) if node >= 0 else []
            _, expect = decode_path(x[b].cpu(), w.cpu(), win[b].cpu(), path)
            assert torch.allclose(new[b].cpu().double(), expect), (nodes, b)
    assert torch.equal(win, win_before)


@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("N", [1, 5, 65])
def test_reference_matches_plain_decoding(shape: str, N: int) -> None:
    check(tree_causal_conv1d_reference, tree_conv_commit_reference, 2, N, 8, shape)


@pytest.mark.parametrize("shape", ["best_first", "random"])
def test_triton_matches_plain_decoding(shape: str, triton_device: str) -> None:
    check(tree_causal_conv1d, tree_conv_commit, 2, 20, 40, shape, triton_device)


def test_triton_bf16_and_strided_input_match_twin(triton_device: str) -> None:
    """x as a strided view (like a slice of a fused projection), bf16 in and out, no activation."""
    (x, w, win), parents = make_case(1, 12, 24, "binary", triton_device, torch.bfloat16)
    x = torch.cat([x, x], dim=-1)[..., :24]
    parents = parents.to(triton_device)
    y = tree_causal_conv1d(x, w, parents, win, activation=None)
    assert rel_err(y, tree_causal_conv1d_reference(x, w, parents, win, activation=None)) <= 1e-2


def test_triton_reads_the_given_ancestor_table(triton_device: str) -> None:
    """The kernel takes each node's taps from the step's `nearest_ancestors` table, not from parents: with
    another tree's table (same N) it gives that tree's conv, and a table of the wrong shape or dtype is refused
    by name."""
    (x, w, win), parents = make_case(2, 17, 24, "best_first", triton_device)
    other = torch.stack([random_parents(17, "chain"), random_parents(17, "random", seed=5)]).to(triton_device)
    parents = parents.to(triton_device)
    y = tree_causal_conv1d(x, w, parents, win, nearest=nearest_ancestors(other))
    assert rel_err(y, tree_causal_conv1d_reference(x, w, other, win)) <= 1e-5
    assert not torch.allclose(y, tree_causal_conv1d_reference(x, w, parents, win))
    with pytest.raises(ValueError, match=r"nearest must be int32 \(2, 17, 3\)"):
        tree_causal_conv1d(x, w, parents, win, nearest=nearest_ancestors(parents).long())
    with pytest.raises(ValueError, match=r"got torch.int32 \(2, 16, 3\)"):
        tree_causal_conv1d(x, w, parents, win, nearest=nearest_ancestors(parents[:, :16]))


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the CPU runs Triton's interpreter in this process")
def test_cpu_tensors_run_the_twin() -> None:
    (x, w, win), parents = make_case(1, 7, 8, "random")
    assert torch.equal(tree_causal_conv1d(x, w, parents, win), tree_causal_conv1d_reference(x, w, parents, win))
    acc = accepted_mask(parents, [6])
    assert torch.equal(tree_conv_commit(x, parents, acc, win), tree_conv_commit_reference(x, parents, acc, win))


def test_validation_errors() -> None:
    (x, w, win), parents = make_case(1, 6, 8, "random")
    with pytest.raises(ValueError, match="parents"):
        tree_causal_conv1d(x, w, parents[:, :3], win)
    with pytest.raises(ValueError, match="conv_window"):
        tree_causal_conv1d(x, w, parents, win[:, :, :2])
    with pytest.raises(ValueError, match="weight"):
        tree_causal_conv1d(x, w[:, :3], parents, win)
    with pytest.raises(ValueError, match="activation"):
        tree_causal_conv1d(x, w, parents, win, activation="gelu")
    with pytest.raises(ValueError, match="x must be"):
        tree_conv_commit(x[0], parents, parents >= 0, win)


@pytest.mark.gpu
def test_gpu_matches_twin_27b_shapes() -> None:
    """GDN conv of Qwen3.6-27B: C = 2·16·128 + 48·128 = 10240, N = 65, bf16."""
    (x, w, win), parents = make_case(1, 65, 10240, "best_first", "cuda", torch.bfloat16)
    parents = parents.cuda()
    y = tree_causal_conv1d(x, w, parents, win)
    assert rel_err(y, tree_causal_conv1d_reference(x, w, parents, win)) <= 1e-2
    acc = accepted_mask(parents.cpu(), [64]).cuda()
    assert torch.equal(tree_conv_commit(x, parents, acc, win), tree_conv_commit_reference(x, parents, acc, win))


def test_triton_commit_in_place_equals_a_new_window(triton_device: str) -> None:
    """out = the window itself: every program loads its three inputs before storing, so the result is the same
    (paths shorter than the window read old window slots that the store overwrites)."""
    (x, w, win), parents = make_case(2, 9, 24, "binary", triton_device)
    parents = parents.to(triton_device)
    for nodes in ([0], [0, 1], [0, 2, 5]):
        acc = accepted_mask(parents.cpu(), [nodes[-1]]).to(triton_device)  # row 1: nothing accepted
        expect = tree_conv_commit(x, parents, acc, win)
        window = win.clone()
        assert tree_conv_commit(x, parents, acc, window, out=window) is window
        assert torch.equal(window, expect), nodes


def test_triton_keep_input_copies_x_and_stacked_commit_shares_trees(triton_device: str) -> None:
    """keep_input receives x while the output is unchanged; a commit over two stacked copies of the batch with
    P = B trees (row b follows tree b % P) equals committing each copy with its own trees."""
    (x, w, win), parents = make_case(2, 21, 24, "best_first", triton_device)
    parents = parents.to(triton_device)
    strided = torch.cat([x, x], dim=-1)[..., :24]  # a strided view, as the model's split projection gives
    kept = torch.empty_like(x)
    y = tree_causal_conv1d(strided, w, parents, win, keep_input=kept)
    assert torch.equal(kept, x) and torch.equal(y, tree_causal_conv1d(x, w, parents, win))
    acc = accepted_mask(parents.cpu(), [20, 7]).to(triton_device)
    stacked = tree_conv_commit(torch.cat([x, 2 * x]), parents, acc, torch.cat([win, -win]))
    expect = torch.cat([tree_conv_commit(x, parents, acc, win), tree_conv_commit(2 * x, parents, acc, -win)])
    assert torch.equal(stacked, expect)
    with pytest.raises(ValueError, match="keep_input"):
        tree_causal_conv1d(x, w, parents, win, keep_input=kept[:, :3])
    with pytest.raises(ValueError, match="parents"):
        tree_conv_commit(torch.cat([x, x[:1]]), parents, acc, torch.cat([win, win[:1]]))  # 3 rows, 2 trees
