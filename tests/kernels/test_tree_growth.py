"""DFLASH_TFM round kernels (re-score pools, publish children, place nodes) against their torch twins, and a whole
Weaver tree grown with the kernels against the torch builder (Triton's interpreter on the CPU, compiled on a GPU)."""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.kernels.tree_growth import reference, weaver_round
from dflash_tfm.spec.weaver import load_weaver
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from dflash_tfm.spec import weaver_tree
from dflash_tfm.spec.weaver_tree import build_weaver_tree

from ..spec.test_weaver import BLOCK, HIDDEN, K, VOCAB, tiny_target
from .test_tree_common import rel_err, triton_device  # noqa: F401  (fixture)


def distinct_ids(rows: int, pool: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(vocab, generator=gen)[:pool] for _ in range(rows)])


def round_state(n: int, depth_max: int, seed: int, device: str) -> dict[str, torch.Tensor]:
    """Node depths in 0 … depth_max (some at the maximum) and path scores of a tree of n slots."""
    gen = torch.Generator().manual_seed(seed)
    depths = torch.randint(0, depth_max + 1, (n,), generator=gen)
    depths[2] = depth_max
    return {"depths": depths.to(device), "scores": (-torch.rand(n, generator=gen) * 5).to(device)}


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_rescore_pool_matches_twin(dtype: torch.dtype, tol: float, triton_device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    V, D, Kd, P, n = 300, 200, 6, 40, 20  # D and P not multiples of the blocks
    w_res = torch.randn(V, D, generator=gen).to(triton_device, dtype)
    rows = torch.randn(5, D, generator=gen).to(triton_device, dtype)
    norm = (1 + 0.1 * torch.randn(D, generator=gen)).to(triton_device, dtype), \
        (0.1 * torch.randn(D, generator=gen)).to(triton_device, dtype), 1e-6
    pool_ids = distinct_ids(Kd, P, V, gen).to(triton_device)
    pool_logits = torch.randn(Kd, P, generator=gen).to(triton_device)
    state = round_state(n, Kd, seed=1, device=triton_device)
    nodes = torch.arange(1, 6, device=triton_device)  # slot 2 sits at depth K: its pool row is clamped
    got = weaver_round.rescore_pool(w_res, rows, pool_ids, pool_logits, state["depths"], nodes, norm)
    want = reference.rescore_pool_reference(w_res, reference.weaver_norm(rows, *norm), pool_ids, pool_logits,
                                            state["depths"], nodes)
    assert got.shape == (5, P) and got.dtype == torch.float32
    assert rel_err(got, want) <= tol


@pytest.mark.parametrize("children", [1, 4, 8, 16])
def test_triton_publish_children_matches_twin(children: int, triton_device: str) -> None:
    gen = torch.Generator().manual_seed(children)
    Kd, P, n, V = 5, 37, 16, 100
    pool_ids = distinct_ids(Kd, P, V, gen).to(triton_device)
    logits = (torch.randn(6, P, generator=gen) * 3).to(triton_device)
    state = round_state(n, Kd, seed=children, device=triton_device)
    nodes = torch.arange(0, 6, device=triton_device)
    frontier = [(torch.full((n, children), -7.0, device=triton_device), torch.zeros(n, children, dtype=torch.long,
                 device=triton_device)) for _ in range(2)]
    weaver_round.publish_children(logits, pool_ids, state["depths"], state["scores"], *frontier[0], nodes)
    reference.publish_children_reference(logits, pool_ids, state["depths"], state["scores"], *frontier[1], nodes)
    (got_score, got_token), (want_score, want_token) = frontier
    assert torch.equal(got_token, want_token)
    assert torch.equal(torch.isinf(got_score), torch.isinf(want_score)) and torch.isinf(got_score[2]).all()
    finite = torch.isfinite(want_score)
    assert torch.allclose(got_score[finite], want_score[finite], rtol=0, atol=1e-5)
    assert (got_score[6:] == -7.0).all()  # rows of other nodes untouched


def test_triton_place_nodes_matches_twin(triton_device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    n, c, placed = 30, 4, 10
    parents = torch.full((n,), -1)
    depths = torch.zeros(n, dtype=torch.long)
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    ancestors[0, 0] = True
    for i in range(1, placed):  # a random tree on the first `placed` slots, parents before children
        parents[i] = int(torch.randint(0, i, (1,), generator=gen))
        depths[i] = depths[parents[i]] + 1
        ancestors[i] = ancestors[parents[i]]
        ancestors[i, i] = True
    flat_score = torch.randn(n * c, generator=gen)
    flat_score[placed * c :] = float("-inf")  # nothing published by unplaced slots
    flat_score[torch.randperm(placed * c, generator=gen)[:9]] = float("-inf")  # consumed entries
    state = {"flat_score": flat_score, "flat_token": torch.randint(0, VOCAB, (n * c,), generator=gen),
             "tokens": torch.randint(0, VOCAB, (n,), generator=gen), "parents": parents, "depths": depths,
             "scores": torch.randn(n, generator=gen), "ancestors": ancestors}
    got = {k: v.clone().to(triton_device) for k, v in state.items()}
    want = {k: v.clone() for k, v in state.items()}
    nodes = torch.arange(placed, placed + 3)
    weaver_round.place_nodes(*got.values(), nodes.to(triton_device), c)
    reference.place_nodes_reference(*want.values(), nodes, c)
    for k in state:
        assert torch.equal(got[k].cpu(), want[k]), k


@pytest.mark.parametrize("budget", [16, 64])
def test_triton_weaver_tree_with_kernels_equals_torch_builder(budget: int, triton_device: str, tmp_path,
                                                              monkeypatch) -> None:
    fused_widths = []  # the fused Weaver step must really run every round's expansion

    def counted(weaver, cache, nodes, *args):
        fused_widths.append(nodes.shape[0])
        return fused(weaver, cache, nodes, *args)

    fused = weaver_tree.fused_step_rows
    monkeypatch.setattr(weaver_tree, "fused_step_rows", counted)
    model, cfg = tiny_target()
    path = tmp_path / "w.pth"
    write_random_weaver_checkpoint(path, cfg, variant=1, seed=4)
    weaver = load_weaver(path, model.to(triton_device), cfg, BLOCK, triton_device, torch.float32)
    gen = torch.Generator().manual_seed(budget)
    root = torch.tensor(5, device=triton_device)
    logits = (torch.randn(K, VOCAB, generator=gen) * 2).to(triton_device)
    h_dflash, h_target = torch.randn(K, HIDDEN, generator=gen).to(triton_device), torch.randn(HIDDEN, generator=gen).to(triton_device)
    got = build_weaver_tree(weaver, root, logits, h_dflash, h_target, budget, pool_size=24,
                            implementation="triton_fused")
    want = build_weaver_tree(weaver, root, logits, h_dflash, h_target, budget, pool_size=24, implementation="torch")
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    width = -(-budget // 16)
    rounds = [1] + [width] * (-(-budget // width) - 1)  # the root, then every round but the last
    assert fused_widths == rounds


@pytest.mark.gpu
def test_round_kernels_match_twins_at_published_shapes() -> None:
    """Vocabulary 248320, d_rank 2048, pool 512, K 15, a 65-node tree, W = 4 nodes, bf16 W_res (the published
    shapes)."""
    gen = torch.Generator().manual_seed(0)
    V, D, Kd, P, n, c = 248320, 2048, 15, 512, 65, 8
    w_res = (torch.randn(V, D, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    rows = torch.randn(4, D, generator=gen).to("cuda", torch.bfloat16)
    norm = (torch.ones(D, device="cuda", dtype=torch.bfloat16), torch.zeros(D, device="cuda", dtype=torch.bfloat16),
            1e-6)
    pool_logits, pool_ids = (torch.randn(Kd, V, generator=gen) * 4).cuda().topk(P, dim=-1)
    state = round_state(n, Kd, seed=1, device="cuda")
    nodes = torch.arange(9, 13, device="cuda")
    logits = weaver_round.rescore_pool(w_res, rows, pool_ids, pool_logits, state["depths"], nodes, norm)
    assert rel_err(logits, reference.rescore_pool_reference(w_res, reference.weaver_norm(rows, *norm), pool_ids,
                                                            pool_logits, state["depths"], nodes)) <= 1e-2
    frontier = [(torch.full((n, c), float("-inf"), device="cuda"), torch.zeros(n, c, dtype=torch.long, device="cuda"))
                for _ in range(2)]
    weaver_round.publish_children(logits, pool_ids, state["depths"], state["scores"], *frontier[0], nodes)
    reference.publish_children_reference(logits, pool_ids, state["depths"], state["scores"], *frontier[1], nodes)
    assert torch.equal(frontier[0][1], frontier[1][1])
    assert torch.allclose(frontier[0][0], frontier[1][0], rtol=0, atol=1e-4)
    ancestors = torch.eye(n, dtype=torch.bool, device="cuda")
    buffers = [frontier[0][0].view(-1), frontier[0][1].view(-1), torch.zeros(n, dtype=torch.long, device="cuda"),
               torch.full((n,), -1, device="cuda"), state["depths"], state["scores"], ancestors]
    got, want = [b.clone() for b in buffers], [b.clone() for b in buffers]
    weaver_round.place_nodes(*got, torch.arange(13, 17, device="cuda"), c)
    reference.place_nodes_reference(*want, torch.arange(13, 17, device="cuda"), c)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
