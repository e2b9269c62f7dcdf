"""Weaver tree builder against a slow Python builder that calls the float64 reference Weaver once per node."""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.spec.chain import build_chain
from dflash_tfm.spec.ddtree import build_ddtree
from dflash_tfm.spec.weaver import load_weaver
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from dflash_tfm.spec.weaver_tree import build_weaver_tree

from .test_chain_ddtree import check_tree
from .test_weaver import BLOCK, HIDDEN, K, VOCAB, RefWeaver, path_to, single_thread, tiny_target  # noqa: F401


def slow_weaver_tree(
    ref: RefWeaver, root: int, logits: torch.Tensor, h_dflash: torch.Tensor, h_target: torch.Tensor, budget: int,
    pool: int, children: int = 8,
) -> tuple[list[int], list[int], list[int]]:
    """MODELS.md tree growth, one node at a time: frontier = {entry: (score, token)} with entry = parent · c + rank;
    each round writes the W = ceil(budget / 16) best entries (ties: lowest entry), then expands them one by one."""
    pool_logits, pool_ids = logits.topk(pool, dim=-1)
    tokens, parents, depths, scores = [root], [-1], [0], [0.0]
    frontier: dict[int, tuple[float, int]] = {}

    def expand(node: int) -> None:
        if depths[node] >= K:
            return
        path = path_to(parents, node)
        query = ref.node_output(h_target, h_dflash, path, [tokens[i] for i in path])
        ids = pool_ids[depths[node]]
        logp = ref.child_logits(query, ids, pool_logits[depths[node]]).log_softmax(-1)
        top, rank = logp.sort(descending=True)
        for r in range(min(children, pool)):
            frontier[node * children + r] = (scores[node] + top[r].item(), ids[rank[r]].item())

    expand(0)
    width = min(-(-budget // 16), children, pool)
    while len(tokens) < budget + 1:
        picked = sorted(frontier, key=lambda e: (-frontier[e][0], e))[: min(width, budget + 1 - len(tokens))]
        new = []
        for entry in picked:
            score, token = frontier.pop(entry)
            new.append(len(tokens))
            tokens.append(token)
            parents.append(entry // children)
            depths.append(depths[entry // children] + 1)
            scores.append(score)
        if len(tokens) < budget + 1:
            for node in new:
                expand(node)
    return tokens, parents, depths


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, cfg = tiny_target()
    out = {}
    for variant in (1, 2):
        path = tmp_path_factory.mktemp("wt") / f"v{variant}.pth"
        payload = write_random_weaver_checkpoint(path, cfg, variant=variant, seed=variant)
        out[variant] = (load_weaver(path, model, cfg, BLOCK, "cpu", torch.float32), RefWeaver(payload, model))
    return out


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(K, VOCAB, generator=gen) * 2.0
    return torch.tensor(seed % VOCAB), logits, torch.randn(K, HIDDEN, generator=gen), torch.randn(HIDDEN, generator=gen)


@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.parametrize("budget", [8, 16, 64])
@pytest.mark.parametrize("children", [8, 16])
def test_weaver_tree_equals_slow_reference(variant: int, budget: int, children: int, setup) -> None:
    weaver, ref = setup[variant]
    root, logits, h_dflash, h_target = inputs(seed=budget + variant)
    tokens, parents, depths = build_weaver_tree(weaver, root, logits, h_dflash, h_target, budget,
                                                children_per_node=children)
    check_tree(tokens, parents, depths, budget + 1, int(root))
    want = slow_weaver_tree(ref, int(root), logits, h_dflash, h_target, budget, pool=VOCAB, children=children)
    assert (tokens.tolist(), parents.tolist(), depths.tolist()) == want


@pytest.mark.parametrize("budget, pool", [(200, None), (64, 3), (40, 2)])
def test_weaver_tree_invariants_large_budget_and_small_pools(budget: int, pool: int | None, setup) -> None:
    weaver, _ = setup[1]
    root, logits, h_dflash, h_target = inputs(seed=5)
    tokens, parents, depths = build_weaver_tree(weaver, root, logits, h_dflash, h_target, budget, pool_size=pool)
    check_tree(tokens, parents, depths, budget + 1, int(root))


def test_pool_of_one_is_the_chain_and_overfull_budgets_are_refused(setup) -> None:
    weaver, _ = setup[2]
    root, logits, h_dflash, h_target = inputs(seed=9)
    got = build_weaver_tree(weaver, root, logits, h_dflash, h_target, K, pool_size=1)
    assert all(torch.equal(a, b) for a, b in zip(got, build_chain(root, logits)))
    with pytest.raises(ValueError, match="cannot always be filled"):
        build_weaver_tree(weaver, root, logits, h_dflash, h_target, K + 1, pool_size=1)


@pytest.mark.gpu
@pytest.mark.parametrize("builder", ["ddtree", "weaver", "weaver_torch"])
def test_builders_capture_in_a_cuda_graph(builder: str, tmp_path) -> None:
    """Static shapes and no host sync: a captured replay on new inputs equals an eager call."""
    model, cfg = tiny_target()
    model = model.cuda()
    path = tmp_path / "w.pth"
    write_random_weaver_checkpoint(path, cfg, variant=1)
    weaver = load_weaver(path, model, cfg, BLOCK, "cuda", torch.float32)
    static = [t.cuda() for t in inputs(seed=1)]

    def build():
        if builder == "ddtree":
            return build_ddtree(static[0], static[1], 64)
        implementation = None if builder == "weaver" else builder[len("weaver_"):]
        return build_weaver_tree(weaver, *static, budget=64, implementation=implementation)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        build()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = build()
    for t, new in zip(static, inputs(seed=2)):
        t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, build()))
