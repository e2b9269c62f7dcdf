"""Tree attention: every node equals plain causal attention over the cache followed by its root→node path.

Oracle: per node, softmax attention of its query over ``[k_cache[:L] | k_tree[path]]`` (float64). Triton
kernels: see test_tree_common for how they run on the CPU; GPU tests use Qwen3.6-27B attention shapes.
"""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.kernels import TRITON_INTERPRETED, compact_accepted_kv, tree_attention
from dflash_tfm.kernels.attention.reference import tree_attention_reference
from dflash_tfm.tree import TREE_SHAPES, ancestor_bitsets, random_parents

from .test_tree_common import rel_err, root_path, triton_device  # noqa: F401  (fixture)


def make_case(B: int, N: int, H: int, Hkv: int, D: int, S: int, shape: str, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> tuple[dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(N * 7 + D)
    parents = torch.stack([random_parents(N, shape, seed=b) for b in range(B)])
    x = {
        "q": torch.randn(B, N, H, D, generator=gen),
        "k_cache": torch.randn(B, S, Hkv, D, generator=gen),
        "v_cache": torch.randn(B, S, Hkv, D, generator=gen),
        "k_tree": torch.randn(B, N, Hkv, D, generator=gen),
        "v_tree": torch.randn(B, N, Hkv, D, generator=gen),
    }
    x = {n: t.to(device=device, dtype=dtype) for n, t in x.items()}
    return {**x, "ancestor_bitsets": ancestor_bitsets(parents).to(device)}, parents


def path_attention(x: dict, parents: torch.Tensor, L: list[int], scale: float) -> torch.Tensor:
    """The oracle, node by node: float64 softmax over the first L cache keys and the path's keys."""
    q = x["q"].cpu().double()
    B, N, H, _ = q.shape
    group = H // x["k_cache"].shape[2]  # query head h reads kv head h // group
    out = torch.empty_like(q)
    for b in range(B):
        for i in range(N):
            path = root_path(parents[b], i)
            keys, values = (torch.cat([x[f"{n}_cache"][b, :L[b]], x[f"{n}_tree"][b, path]]).cpu().double()
                            .repeat_interleave(group, dim=1) for n in "kv")            # [L + depth + 1, H, D]
            p = torch.softmax(torch.einsum("thd,hd->ht", keys, q[b, i]) * scale, dim=-1)
            out[b, i] = torch.einsum("ht,thd->hd", p, values)
    return out


@pytest.mark.parametrize("shape", TREE_SHAPES)
@pytest.mark.parametrize("N", [1, 17, 65])
def test_reference_matches_path_attention(shape: str, N: int) -> None:
    x, parents = make_case(2, N, 4, 2, 16, 40, shape)
    L = [0, 37]
    o = tree_attention_reference(**x, cache_len=torch.tensor(L), scale=0.3)
    assert rel_err(o, path_attention(x, parents, L, 0.3)) <= 1e-5


def test_reference_with_a_host_length_reads_only_the_used_slots() -> None:
    """An int cache_len (a CPU decoder's host length) bounds the slots read: garbage past it cannot leak in."""
    x, parents = make_case(1, 17, 4, 2, 16, 40, "random")
    for name in ("k_cache", "v_cache"):
        x[name][:, 25:] = float("nan")
    o = tree_attention_reference(**x, cache_len=25, scale=0.3)
    assert rel_err(o, path_attention(x, parents, [25], 0.3)) <= 1e-5


@pytest.mark.parametrize("shape, L, splits", [
    ("best_first", [21, 50], 1), ("random", [0, 33], 2), ("binary", 50, 4), ("chain", [64, 3], None)])
def test_triton_matches_path_attention(shape: str, L, splits: int | None, triton_device: str) -> None:
    """GQA 6/2, int or per-sequence cache lengths (incl. empty), one or several cache splits."""
    x, parents = make_case(2, 12, 6, 2, 32, 64, shape, triton_device)
    cache_len = L if isinstance(L, int) else torch.tensor(L, device=triton_device)
    o = tree_attention(**x, cache_len=cache_len, num_splits=splits)
    lens = [L] * 2 if isinstance(L, int) else L
    assert o.shape == x["q"].shape and rel_err(o, path_attention(x, parents, lens, 32**-0.5)) <= 1e-5


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_triton_key_tiles_match_path_attention(block_n: int, triton_device: str) -> None:
    """Every key tile width, with cache lengths that are not multiples of it and two splits."""
    x, parents = make_case(2, 12, 6, 2, 32, 90, "random", triton_device)
    lens = [77, 5]
    o = tree_attention(**x, cache_len=torch.tensor(lens, device=triton_device), num_splits=2, block_n=block_n)
    assert rel_err(o, path_attention(x, parents, lens, 32**-0.5)) <= 1e-5


@pytest.mark.parametrize("block_m, num_stages", [(16, None), (32, 2), (128, 1)])
def test_triton_row_tiles_match_path_attention(block_m: int, num_stages: int | None, triton_device: str) -> None:
    """Row tiles of 16 to 128 and explicit pipeline depths. Each program reads only the tree keys up to its
    last node: with 65 nodes (195 rows) and 16-row tiles, the last program holds only node 64, the first key of
    a new key tile."""
    x, parents = make_case(2, 65, 6, 2, 32, 40, "best_first", triton_device)
    lens = [33, 0]
    o = tree_attention(**x, cache_len=torch.tensor(lens, device=triton_device), num_splits=2, block_m=block_m,
                       num_stages=num_stages)
    assert rel_err(o, path_attention(x, parents, lens, 32**-0.5)) <= 1e-5


@pytest.mark.parametrize("name", ["tree_kernel", "tree_kernel s16", "tree_kernel s4 bn64", "tree_kernel s2 bn64",
                                  "tree_kernel s8 bm128", "tree_kernel s4 bm128"])
def test_triton_verify_attention_candidates_match_path_attention(name: str, triton_device: str) -> None:
    """Each candidate the verify's tuned choice may take (forced by name) attends over the caller's lengths, not
    the length the candidates are timed at."""
    from dflash_tfm.layers import attention

    x, parents = make_case(1, 9, 6, 2, 32, 80, "best_first", triton_device)
    with attention.VERIFY_ATTENTION.forced(name):
        o = attention.verify_attention(x["q"], x["k_tree"], x["v_tree"], x["k_cache"], x["v_cache"],
                                       torch.tensor([61], device=triton_device), x["ancestor_bitsets"], 32**-0.5)
    assert rel_err(o, path_attention(x, parents, [61], 32**-0.5)) <= 1e-5


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_triton_output_gate_matches_gated_path_attention(splits: int, triton_device: str) -> None:
    """A gated layer's o · sigmoid(gate), with the gate a strided view (the second half of each head's q
    projection), applied by the attention kernel (one split) or by the merge (several): the oracle times the
    gate, and the twin."""
    x, parents = make_case(2, 12, 6, 2, 32, 64, "random", triton_device)
    q_and_gate = torch.randn(2, 12, 6, 64, generator=torch.Generator().manual_seed(3)).to(triton_device)
    gate = q_and_gate[..., 32:]
    lens = [40, 7]
    cache_len = torch.tensor(lens, device=triton_device)
    o = tree_attention(**x, cache_len=cache_len, num_splits=splits, gate=gate)
    oracle = path_attention(x, parents, lens, 32**-0.5) * torch.sigmoid(gate.cpu().double())
    assert o.shape == x["q"].shape and rel_err(o, oracle) <= 1e-5
    assert rel_err(o, tree_attention_reference(**x, cache_len=cache_len, gate=gate)) <= 1e-5
    with pytest.raises(ValueError, match=r"gate must be q's shape"):
        tree_attention(**x, cache_len=cache_len, gate=gate[:, :11])


def test_triton_more_than_64_nodes(triton_device: str) -> None:
    """Two bitset words and two query row blocks; head_dim not a power of two."""
    x, parents = make_case(1, 70, 2, 1, 24, 20, "best_first", triton_device)
    o = tree_attention(**x, cache_len=20, scale=0.2)
    assert rel_err(o, path_attention(x, parents, [20], 0.2)) <= 1e-5


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the CPU runs Triton's interpreter in this process")
def test_cpu_tensors_run_the_twin() -> None:
    x, _ = make_case(1, 7, 4, 2, 16, 10, "random")
    assert torch.equal(tree_attention(**x, cache_len=6), tree_attention_reference(**x, cache_len=6))


def test_compact_accepted_kv() -> None:
    """Root + accepted nodes land in slots L … L+a (per sequence); other slots are untouched."""
    x, _ = make_case(2, 10, 2, 2, 8, 16, "random")
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    path = torch.tensor([[0, 3, 7, -1], [0, 2, 5, 9]])
    new_len = compact_accepted_kv(k_cache, v_cache, torch.tensor([4, 9]), x["k_tree"], x["v_tree"], path)
    assert new_len.tolist() == [7, 13]
    for b, (L, nodes) in enumerate([(4, [0, 3, 7]), (9, [0, 2, 5, 9])]):
        assert torch.equal(k_cache[b, L:L + len(nodes)], x["k_tree"][b, nodes])
        assert torch.equal(v_cache[b, L:L + len(nodes)], x["v_tree"][b, nodes])
        keep = [s for s in range(16) if not L <= s < L + len(nodes)]
        assert torch.equal(k_cache[b, keep], x["k_cache"][b, keep])
        assert torch.equal(v_cache[b, keep], x["v_cache"][b, keep])


def test_validation_errors() -> None:
    x, _ = make_case(1, 5, 4, 2, 16, 8, "random")
    with pytest.raises(ValueError, match="ancestor_bitsets"):
        tree_attention(**{**x, "ancestor_bitsets": x["ancestor_bitsets"].int()}, cache_len=3)
    with pytest.raises(ValueError, match="k_tree"):
        tree_attention(**{**x, "k_tree": x["k_tree"][:, :4]}, cache_len=3)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(**{**x, "q": x["q"][:, :, :3]}, cache_len=3)
    with pytest.raises(ValueError, match="k_cache"):
        tree_attention(**{**x, "v_cache": x["v_cache"][:, :4]}, cache_len=3)
    with pytest.raises(ValueError, match="block_n"):
        tree_attention(**x, cache_len=3, block_n=48)
    with pytest.raises(ValueError, match="block_m"):
        tree_attention(**x, cache_len=3, block_m=8)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [16, 65, 129])
def test_gpu_matches_twin_27b_shapes(N: int) -> None:
    """Qwen3.6-27B attention: 24 query heads, 4 kv heads, head_dim 256, cache 4096, bf16; default tiles, every
    tile of the verify's tuned choice, and 128-row tiles with 2 pipeline stages; and the output gate."""
    from dflash_tfm.layers.attention import VERIFY_TILES

    x, _ = make_case(1, N, 24, 4, 256, 4096, "best_first", "cuda", torch.bfloat16)
    for cache_len in (4000, torch.tensor([4096], device="cuda"), 0):
        ref = tree_attention_reference(**x, cache_len=cache_len)
        for options in ({}, *VERIFY_TILES.values(), {"block_m": 128, "num_stages": 2, "num_splits": 4}):
            assert rel_err(tree_attention(**x, cache_len=cache_len, **options), ref) <= 2e-2
    gate = torch.randn(1, N, 24, 512, device="cuda", dtype=torch.bfloat16)[..., 256:]  # Qwen3.6's gated q rows
    for splits in (1, 4):
        ref = tree_attention_reference(**x, cache_len=4000, gate=gate)
        assert rel_err(tree_attention(**x, cache_len=4000, num_splits=splits, gate=gate), ref) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_gpu_decode_attention_matches_sdpa(batch: int) -> None:
    """Decode attention at Qwen3.6-27B's shapes (24 query / 4 kv heads, d 256) over a 2048-slot bucket: the
    tree-attention kernel (token as a one-node tree, 32 cache splits) gives masked SDPA's output."""
    from dflash_tfm.layers import attention

    gen = torch.Generator(device="cuda").manual_seed(batch)
    q = torch.randn(batch, 1, 24, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache = torch.randn(batch, 2048, 4, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(batch, 2048, 4, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    positions = torch.tensor([[1500 - 7 * b] for b in range(batch)], device="cuda")
    rows = torch.arange(batch, device="cuda")
    k, v = k_cache[rows, positions[:, 0]].unsqueeze(1), v_cache[rows, positions[:, 0]].unsqueeze(1)
    got = attention.decode_attention(q, k, v, k_cache, v_cache, positions, 256**-0.5)
    expected = attention.causal_cache_attention(q, k_cache, v_cache, positions, 256**-0.5)
    assert rel_err(got, expected) <= 1e-2


@pytest.mark.parametrize("bucket", [64, 256])
def test_triton_decode_attention_equals_sdpa(bucket: int, triton_device: str) -> None:
    """Decode attention (the tree kernel, in as many cache splits as the bucket allows) gives masked SDPA's
    output over a bucket longer than the keys in use."""
    from dflash_tfm.layers import attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 6, 32, generator=gen).to(triton_device)
    k_cache, v_cache = (torch.randn(2, bucket, 2, 32, generator=gen).to(triton_device) for _ in range(2))
    positions = torch.tensor([[bucket - 56], [37]], device=triton_device)
    rows = torch.arange(2, device=triton_device)
    k, v = k_cache[rows, positions[:, 0]].unsqueeze(1), v_cache[rows, positions[:, 0]].unsqueeze(1)
    expected = attention.causal_cache_attention(q, k_cache, v_cache, positions, 32**-0.5)
    got = attention.decode_attention(q, k, v, k_cache, v_cache, positions, 32**-0.5)
    assert rel_err(got, expected) <= 1e-4


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("devices", [(), ("cpu",)], ids=["sdpa", "tree_kernel"])
def test_triton_drafter_block_attention_paths_agree(devices: tuple, causal: bool, triton_device: str,
                                                    monkeypatch) -> None:
    """The drafter's block attention with no window in the way (the context before the block + the block, all of
    it or causally) through either path of `block_attention` equals plain attention over those keys."""
    from dflash_tfm.spec import dflash

    gen = torch.Generator().manual_seed(1)
    B, Hq, Hkv, D, S, L, kv_len = 8, 8, 2, 32, 128, 37, 64
    q = torch.randn(1, B, Hq, D, generator=gen).to(triton_device)
    k_cache, v_cache = (torch.randn(1, S, Hkv, D, generator=gen).to(triton_device) for _ in range(2))
    positions = torch.arange(L, L + B, device=triton_device).view(1, B)
    k, v = k_cache[:, L : L + B], v_cache[:, L : L + B]  # the block's K/V, already written at L .. L+B-1
    window = 1000 if causal else None  # wider than every distance here: only the in-block causality remains
    visible = dflash.attention_mask(positions, torch.arange(kv_len, device=triton_device).view(1, -1), window, causal)
    mask = dflash.additive_mask(visible.repeat(1, 1, Hq // Hkv, 1), q.dtype)
    keys, values = (t[0, : L + B].repeat_interleave(Hq // Hkv, dim=1) for t in (k_cache, v_cache))
    scores = torch.einsum("qhd,khd->qhk", q[0], keys).mul(D**-0.5)
    if causal:  # block query i sees the context and block keys 0 .. i
        scores = scores.masked_fill(torch.arange(L + B, device=triton_device) > positions[0, :, None, None], float("-inf"))
    expected = torch.einsum("qhk,khd->qhd", scores.softmax(-1), values)
    monkeypatch.setattr(dflash, "TREE_KERNEL_DEVICES", devices)
    got = dflash.block_attention(q, k, v, k_cache, v_cache, positions, kv_len, mask, D**-0.5, causal)
    assert rel_err(got.view(B, Hq, D), expected) <= 1e-4
