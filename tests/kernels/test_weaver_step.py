"""The fused Weaver step (``spec.weaver_tree.fused_step_rows``: the kernels of ``kernels.tree_growth.weaver_step``)
against its twin, the torch ``Weaver.step``: the rows it returns (through ``out_norm``) and the K/V it writes, for
both Weaver architectures (SwiGLU + RoPE, GELU + learned positions), one and two blocks, nodes whose ancestors were
written by earlier calls (Triton's interpreter on the CPU, compiled on a GPU; the published shapes in bf16 on the
GPU)."""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.kernels import TRITON_INTERPRETED, use_triton
from dflash_tfm.kernels.tree_growth import reference, weaver_round, weaver_step
from dflash_tfm.spec.weaver import NORM_EPS, load_weaver
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from dflash_tfm.spec.weaver_tree import fused_step_rows

from ..spec.test_weaver import BLOCK, HIDDEN, K, tiny_target
from .test_tree_common import rel_err, triton_device  # noqa: F401  (fixture)


def random_tree(n: int, leaves: int, max_depth: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Parents before children, depths ≤ max_depth (reached), the last ``leaves`` nodes children of earlier ones only:
    (depths [n], inclusive ancestors [n, n] bool)."""
    depths = torch.zeros(n, dtype=torch.long)
    ancestors = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        candidates = [j for j in range(min(i, n - leaves)) if depths[j] < max_depth]
        pick = int(torch.randint(0, len(candidates), (1,), generator=gen))
        parent = i - 1 if i <= max_depth else candidates[pick]  # a chain to max_depth first, then random
        depths[i] = depths[parent] + 1
        ancestors[i] |= ancestors[parent]
    return depths, ancestors


def step_case(weaver, device: str, seed: int, n: int = 28, W: int = 5):
    """A prefix cache with nodes 0 … n − W − 1 already stepped (one node per call, in order), and the last W
    nodes (children of those, so none an ancestor of another, as in a tree round) to step now."""
    gen = torch.Generator().manual_seed(seed)
    d_model = weaver.config.d_model
    depths, ancestors = random_tree(n, W, weaver.config.K + 1, gen)  # some nodes beyond K: positions are clamped
    tokens = torch.randint(0, weaver.token_table.shape[0], (n,), generator=gen)
    cache = weaver.encode_prefix(torch.randn(d_model, generator=gen).to(device),
                                 torch.randn(weaver.config.K, d_model, generator=gen).to(device), n)
    tokens, depths, ancestors = tokens.to(device), depths.to(device), ancestors.to(device)
    for j in range(n - W):
        s = torch.tensor([j], device=device)
        weaver.step(cache, s, tokens[s], depths[s], ancestors[s])
    return cache, torch.arange(n - W, n, device=device), tokens, depths, ancestors


def clone(cache):
    return type(cache)(cache.k.clone(), cache.v.clone(), cache.prefix_len)


@pytest.mark.parametrize("variant, layers", [(1, 1), (1, 2), (2, 1)])
def test_triton_weaver_step_matches_torch_step(variant: int, layers: int, triton_device: str, tmp_path) -> None:
    model, cfg = tiny_target()
    path = tmp_path / "w.pth"
    write_random_weaver_checkpoint(path, cfg, variant=variant, num_layers=layers, seed=variant)
    weaver = load_weaver(path, model.to(triton_device), cfg, BLOCK, triton_device, torch.float32)
    cache, nodes, tokens, depths, ancestors = step_case(weaver, triton_device, seed=layers)
    assert int(depths.max()) > K  # the clamped positions are exercised
    want_cache, got_cache = clone(cache), clone(cache)
    want = weaver.step(want_cache, nodes, tokens[nodes], depths[nodes], ancestors[nodes])
    rows = fused_step_rows(weaver, got_cache, nodes, tokens, depths, ancestors)
    assert rel_err(weaver.out_norm(rows), want) <= 1e-5
    assert rel_err(got_cache.k, want_cache.k) <= 1e-5 and rel_err(got_cache.v, want_cache.v) <= 1e-5
    # The output norm fused into the pool re-scoring equals re-scoring the torch step's queries.
    gen = torch.Generator().manual_seed(0)
    pool_logits, pool_ids = torch.randn(K, weaver.w_res.shape[0], generator=gen).to(triton_device).topk(24, dim=-1)
    norm = (weaver.out_norm.weight, weaver.out_norm.bias, NORM_EPS)
    fused = weaver_round.rescore_pool(weaver.w_res, rows, pool_ids, pool_logits, depths, nodes, norm)
    plain = reference.rescore_pool_reference(weaver.w_res, want, pool_ids, pool_logits, depths, nodes)
    assert rel_err(fused, plain) <= 1e-5


def test_weaver_step_rejects_too_many_nodes(tmp_path) -> None:
    model, cfg = tiny_target(HIDDEN)
    path = tmp_path / "w.pth"
    write_random_weaver_checkpoint(path, cfg)
    weaver = load_weaver(path, model, cfg, BLOCK, "cpu", torch.float32)
    n = weaver_step.MAX_ROWS + 1
    cache = weaver.encode_prefix(torch.zeros(HIDDEN), torch.zeros(K, HIDDEN), n)
    if use_triton(cache.k):  # (on the CPU without the interpreter the twin runs, any width)
        with pytest.raises(ValueError, match="nodes"):
            fused_step_rows(weaver, cache, torch.arange(n), torch.zeros(n, dtype=torch.long),
                            torch.zeros(n, dtype=torch.long), torch.eye(n, dtype=torch.bool))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", list(weaver_step.ROW_TILES))
def test_weaver_step_matches_torch_step_at_published_shapes(tile: str, tmp_path) -> None:
    """d_rank 2048, 16 heads, MLP 2048, K 15, a 65-node tree, W = 4, bf16 (the published Weaver), every tuned tile
    of the projections; three calls in a row give equal rows (the K-split tiles leave their counters zeroed)."""
    model, cfg = tiny_target(5120)
    path = tmp_path / "w.pth"
    write_random_weaver_checkpoint(path, cfg, d_rank=2048, num_heads=16, mlp_dim=2048)
    weaver = load_weaver(path, model.cuda(), cfg, BLOCK, "cuda", torch.bfloat16)
    cache, nodes, tokens, depths, ancestors = step_case(weaver, "cuda", seed=0, n=65, W=4)
    want_cache, got_cache = clone(cache), clone(cache)
    want = weaver.step(want_cache, nodes, tokens[nodes], depths[nodes], ancestors[nodes])
    with weaver_step.ROWS_MATMUL.forced(tile):
        runs = [fused_step_rows(weaver, got_cache, nodes, tokens, depths, ancestors) for _ in range(3)]
    assert rel_err(weaver.out_norm(runs[0]).float(), want.float()) <= 2e-2
    assert rel_err(got_cache.k.float(), want_cache.k.float()) <= 2e-2
    assert all(torch.equal(run, runs[0]) for run in runs[1:])


@pytest.mark.skipif(TRITON_INTERPRETED, reason="the interpreter replaces the kernels: nothing to compile")
def test_kernels_compile_for_hopper() -> None:
    """Every configuration the fused step launches compiles to sm_90 code (Triton's own compiler and ptxas, no
    GPU needed): the interpreter above checks the numbers, not that the GPU compiler accepts the kernels."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bf, i64 = "*bf16", "*i64"
    matmul = dict(x=bf, res=bf, x_out=bf, tokens=i64, nodes=i64, depths=i64, pos_emb=bf, norm_w=bf, norm_b=bf,
                  w=bf, bias=bf, y=bf, partial="*fp32", arrivals="*i32", M="i32", N="i32", K="i32", KPOS="i32",
                  K_SPLIT="i32", eps="fp32")
    attention = dict(qkv=bf, cache_k=bf, cache_v=bf, cos="*fp32", sin="*fp32", nodes=i64, depths=i64,
                     ancestors="*u8", out=bf, P="i32", NSLOTS="i32", H="i32", KPOS="i32", scale="fp32")
    rescore = dict(w_res=bf, query=bf, norm_w=bf, norm_b=bf, pool_ids=i64, pool_logits="*fp32", depths=i64,
                   nodes=i64, out="*fp32", P="i32", D="i32", K="i32", eps="fp32")
    step_flags = [dict(GATHER=True, POS=pos, NORM=True, ACT=0, HAS_BIAS=False, RESIDUAL=False) for pos in (0, 1)]
    step_flags += [dict(GATHER=False, POS=False, NORM=n, ACT=a, HAS_BIAS=b, RESIDUAL=r)
                   for n, a, b, r in ((False, 0, False, True), (True, 1, True, False), (True, 2, True, False),
                                      (False, 0, True, True))]
    cases = [(weaver_step._rows_matmul_kernel, matmul, dict(f, PRECISION="tf32", BM=16, BN=32, BK=128, SPLIT=1))
             for f in step_flags]
    cases += [(weaver_step._node_attention_kernel, attention, dict(ROTARY=r, D=128, BT=32)) for r in (True, False)]
    cases.append((weaver_round._rescore_pool_kernel, rescore, dict(BP=weaver_round.RESCORE_POOL_ROWS, BD=256)))
    # The round's bookkeeping at both tree widths (8 published, 16 default) for 65- and 129-node trees.
    publish = dict(logits="*fp32", pool_ids=i64, depths=i64, scores="*fp32", frontier_score="*fp32",
                   frontier_token=i64, nodes=i64, P="i32", K="i32")
    place = dict(flat_score="*fp32", flat_token=i64, tokens=i64, parents=i64, depths=i64, scores="*fp32",
                 ancestors="*u8", nodes=i64, E="i32", N="i32")
    for c in (8, 16):
        cases.append((weaver_round._publish_children_kernel, publish, dict(C=c, BP=512, FLOOR=-1e30)))
        cases += [(weaver_round._place_nodes_kernel, place, dict(W=w, C=c, BE=triton.next_power_of_2(n * c),
                                                                 BN=triton.next_power_of_2(n)))
                  for n, w in ((65, 4), (129, 8))]
    options = [{"num_warps": 4}] * len(cases)
    cases.append((weaver_round._publish_children_kernel, publish, dict(C=16, BP=512, FLOOR=-1e30)))
    options.append({"num_warps": weaver_round.PUBLISH_WARPS})
    for tile in filter(None, weaver_step.ROW_TILES.values()):  # the timed tiles, on SwiGLU's flags (+ residual)
        BN, BK, warps, stages, split = tile
        for flags in (step_flags[3], step_flags[2]):
            constexprs = dict(flags, PRECISION="tf32", BM=16, BN=BN, BK=BK, SPLIT=split)
            cases.append((weaver_step._rows_matmul_kernel, matmul, constexprs))
            options.append({"num_warps": warps, "num_stages": stages})
    for (fn, signature, constexprs), option in zip(cases, options, strict=True):
        source = ASTSource(fn=fn, signature=signature | dict.fromkeys(constexprs, "constexpr"), constexprs=constexprs)
        assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options=option).asm["cubin"]


@pytest.mark.parametrize("tile", [t for t in weaver_step.ROW_TILES if t != "default"])
def test_triton_weaver_step_every_tuned_tile_matches_torch_step(tile: str, triton_device: str, tmp_path) -> None:
    model, cfg = tiny_target()
    path = tmp_path / "w.pth"
    write_random_weaver_checkpoint(path, cfg, variant=1, num_layers=2, seed=3)
    weaver = load_weaver(path, model.to(triton_device), cfg, BLOCK, triton_device, torch.float32)
    cache, nodes, tokens, depths, ancestors = step_case(weaver, triton_device, seed=2)
    want_cache, got_cache = clone(cache), clone(cache)
    want = weaver.step(want_cache, nodes, tokens[nodes], depths[nodes], ancestors[nodes])
    with weaver_step.ROWS_MATMUL.forced(tile):
        rows = fused_step_rows(weaver, got_cache, nodes, tokens, depths, ancestors)
    assert rel_err(weaver.out_norm(rows), want) <= 1e-5
