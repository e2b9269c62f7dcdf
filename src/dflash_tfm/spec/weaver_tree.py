"""DFLASH_TFM proposal tree: best-first growth where Weaver re-scores the DFlash candidates of every node.

Per decode step (MODELS.md "Weaver", tree growth of the original): the candidate pool of depth k is the top
``pool`` tokens of the DFlash logits at depth k. The root is expanded first; expanding a node at depth d scores
its depth-(d + 1) pool with ``dflash_logit + W_res · out_norm(x_node)``, log-softmaxes over the pool and
publishes its top ``children_per_node`` children to a frontier with score = parent score + child log-prob.
Every round takes the W = ceil(budget / 16) best frontier entries, writes them as tree nodes and expands them
together in ONE batched Weaver step (`expand_nodes`), until budget + 1 nodes.

Static layout (as in the original's frontier kernels): the frontier has ``children_per_node`` entries per node
slot, entry ``slot · c + r`` = the r-th child of node ``slot``; a round picks the best entries by ``topk``
(exactly equal scores may come in either order; continuous logits have none). Nodes at depth K publish nothing
(−inf); the last round's nodes are not expanded. Everything is a fixed sequence of tensor ops or Triton launches
(``kernels.tree_growth``) on static shapes (the number of rounds and their widths depend on ``budget`` only):
no host sync, CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.tree_growth import reference, weaver_round, weaver_step
from dflash_tfm.layers.compile import fuse_on_cuda
from dflash_tfm.spec.weaver import NORM_EPS, Weaver, WeaverCache
from dflash_tfm.speculative_config import DEFAULT_CHILDREN_PER_NODE

# Nodes per batched Weaver step = ceil(budget / ROUND_UNIT). Wider rounds mean fewer Weaver steps but a less
# best-first tree: at unit 8 (budget 64: 8 rounds instead of 16) SmolLM2's exact expected τ fell 1.7 % at T = 0
# and held at T = 1 (3 held-out prompts × 96 tokens per set); what the GPU's launch-bound rounds save is to be
# timed (`benchmarks.bench_spec_step --tfm-round-units 16 8`).
ROUND_UNIT = 16


def round_width(budget: int, children: int) -> int:
    """Nodes written per round: ceil(budget / 16), capped at the children one node publishes.

    The cap only binds for budget > 16 · children (> 128 by default): the first round after the root can never
    find more than ``children`` frontier entries, and unlike the original we do not emit masked padding nodes.
    """
    return max(1, min(-(-budget // ROUND_UNIT), children))


def check_fillable(budget: int, width: int, children: int, max_depth: int) -> None:
    """Raise ValueError unless every round is guaranteed ``width`` live frontier entries, whatever the scores.

    Before a round with n nodes of which m sit at depth K, the frontier holds c·(n − m) − (n − 1) live entries
    (every node of depth < K published c children; n − 1 of them became nodes). The worst case takes the largest
    m possible: m nodes at depth K need ⌈m/c⌉ parents at depth K − 1 and a chain of K − 1 nodes above them.
    Only tiny pools or very large budgets can fail.
    """
    n = 1
    while n < budget + 1:
        w = min(width, budget + 1 - n)
        spare = n - max_depth + 1
        m = spare - -(-spare // (children + 1)) if spare > 0 else 0
        if children * (n - m) - (n - 1) < w:
            raise ValueError(f"a tree of {budget + 1} nodes with {children} children per node and depth "
                             f"<= {max_depth} cannot always be filled {width} nodes per round")
        n += w


def node_queries(nodes: torch.Tensor, weaver: Weaver, cache: WeaverCache, tokens: torch.Tensor,
                 depths: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """One batched Weaver step over node slots ``nodes`` [W] (their K/V written into ``cache``) → queries [W, d_rank]."""
    return weaver.step(cache, nodes, tokens[nodes], depths[nodes], ancestors[nodes])


def expand_nodes(
    nodes: torch.Tensor, weaver: Weaver, cache: WeaverCache, tokens: torch.Tensor, depths: torch.Tensor,
    ancestors: torch.Tensor, scores: torch.Tensor, pool_ids: torch.Tensor, pool_logits: torch.Tensor,
    frontier_score: torch.Tensor, frontier_token: torch.Tensor,
) -> None:
    """The Weaver step over ``nodes``, then each node's top children published into its frontier row (nodes at
    depth K publish −inf), as torch ops (the twins of ``kernels.tree_growth``)."""
    query = node_queries(nodes, weaver, cache, tokens, depths, ancestors)
    logits = reference.rescore_pool_reference(weaver.w_res, query, pool_ids, pool_logits, depths, nodes)
    reference.publish_children_reference(logits, pool_ids, depths, scores, frontier_score, frontier_token, nodes)


def fused_step_rows(weaver: Weaver, cache: WeaverCache, nodes: torch.Tensor, tokens: torch.Tensor,
                    depths: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """``Weaver.step`` of node slots ``nodes`` [W] before its ``out_norm`` as five Triton launches per block
    (``kernels.tree_growth.weaver_step``): x [W, d_rank], the nodes' K/V written into ``cache``. tokens, depths
    [N] long and ancestors [N, N] bool are the tree's whole buffers (read at ``nodes`` on the device). No node of
    ``nodes`` may be an ancestor of another (true of a round: see the kernels' module docstring). On a CPU without
    Triton's interpreter: its twin, ``Weaver.step_rows``."""
    if not use_triton(nodes):
        return weaver.step_rows(cache, nodes, tokens[nodes], depths[nodes], ancestors[nodes])
    cfg = weaver.config
    W, d = nodes.shape[0], cfg.d_rank
    if not 1 <= W <= weaver_step.MAX_ROWS:
        raise ValueError(f"the fused Weaver step takes 1 … {weaver_step.MAX_ROWS} nodes, got {W}")
    if cfg.head_dim & (cfg.head_dim - 1) or cfg.head_dim < 2:
        raise ValueError(f"the fused Weaver attention needs a power-of-two head dim, got {cfg.head_dim}")
    new = lambda cols: torch.empty(W, cols, dtype=weaver.token_table.dtype, device=nodes.device)  # noqa: E731
    rope = (weaver.rope_cos, weaver.rope_sin) if cfg.rotary else None
    x = new(d)
    for layer, block in enumerate(weaver.blocks):
        qkv, norm_attn = new(3 * d), (block.norm_attn.weight, block.norm_attn.bias, NORM_EPS)
        if layer == 0:
            gather = (tokens, nodes, depths, None if cfg.rotary else weaver.pos_emb, x)
            weaver_step.rows_matmul(weaver.token_table, block.qkv_proj.weight, qkv, norm=norm_attn, gather=gather)
        else:
            weaver_step.rows_matmul(x, block.qkv_proj.weight, qkv, norm=norm_attn)
        attn = new(d)
        weaver_step.node_attention(qkv, cache.k[layer], cache.v[layer], rope, nodes, depths, ancestors, attn,
                                   cache.prefix_len, cfg.K)
        x1 = new(d)
        weaver_step.rows_matmul(attn, block.o_proj.weight, x1, res=x)
        up, down = (block.gate_up_proj, block.down_proj) if block.swiglu else (block.fc1, block.fc2)
        act = new(cfg.mlp_dim)
        weaver_step.rows_matmul(x1, up.weight, act, norm=(block.norm_mlp.weight, block.norm_mlp.bias, NORM_EPS),
                                bias=up.bias, act=weaver_step.SWIGLU if block.swiglu else weaver_step.GELU)
        x = new(d)
        weaver_step.rows_matmul(act, down.weight, x, bias=down.bias, res=x1)
    return x


def expand_nodes_with_kernels(
    nodes: torch.Tensor, weaver: Weaver, cache: WeaverCache, tokens: torch.Tensor, depths: torch.Tensor,
    ancestors: torch.Tensor, scores: torch.Tensor, pool_ids: torch.Tensor, pool_logits: torch.Tensor,
    frontier_score: torch.Tensor, frontier_token: torch.Tensor,
) -> None:
    """:func:`expand_nodes` as Triton launches: the Weaver step (`fused_step_rows`), the re-scoring with the
    step's output norm in it, and the publishing."""
    rows = fused_step_rows(weaver, cache, nodes, tokens, depths, ancestors)
    norm = (weaver.out_norm.weight, weaver.out_norm.bias, NORM_EPS)
    logits = weaver_round.rescore_pool(weaver.w_res, rows, pool_ids, pool_logits, depths, nodes, norm)
    weaver_round.publish_children(logits, pool_ids, depths, scores, frontier_score, frontier_token, nodes)


# On CUDA each is one compiled function: inductor fuses the step's norms, RoPE, softmax and scoring into a few
# kernels (a round is launch-bound: W ≤ 8 rows).
expand_nodes_compiled = fuse_on_cuda(expand_nodes)
place_nodes_compiled = fuse_on_cuda(reference.place_nodes_reference)
# How a round runs: "torch", the compiled functions above (the twins); "triton_fused", the Triton kernels (a
# round is ~8 launches). On CUDA the kernels: they built a budget-64 tree in 1.27–1.63 ms where the torch rounds
# took 2.39–3.15 (and the round kernels around the compiled torch step, since removed, 1.51–1.82; four H200 runs,
# docs/data/perf/spec_step_h200_2026-12-03*.json).
EXPANSIONS = {"torch": expand_nodes_compiled, "triton_fused": expand_nodes_with_kernels}
ROUND_IMPLEMENTATIONS = tuple(EXPANSIONS)


@torch.no_grad()
def build_weaver_tree(
    weaver: Weaver, root_token: torch.Tensor, logits: torch.Tensor, h_dflash: torch.Tensor, h_target: torch.Tensor,
    budget: int, pool_size: int | None = None, children_per_node: int = DEFAULT_CHILDREN_PER_NODE,
    implementation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grow a Weaver tree of ``budget`` nodes below ``root_token``.

    logits [K, V] fp32 (row k − 1 = depth k); h_dflash [K, d_model]; h_target [d_model] (see
    :meth:`Weaver.encode_prefix`). ``pool_size`` defaults to the checkpoint's ``candidate_pool_size`` and is
    clamped to V. Returns tokens, parents, depths ``[budget + 1]`` long (node 0 = root, parent −1; parents
    before children; distinct sibling tokens; depth ≤ K). The chain fallback for budget + 1 ≤ block size is
    the caller's. ``implementation`` (one of ROUND_IMPLEMENTATIONS; both grow the same tree up to rounding, equal
    in the fp32 tests): "torch" runs each round as compiled torch ops, "triton_fused" as the kernels of
    ``kernels.tree_growth``; None (default): "triton_fused" on CUDA, "torch" elsewhere (see `EXPANSIONS`).
    """
    K, V = logits.shape
    if K != weaver.config.K or h_dflash.shape[0] != K:
        raise ValueError(f"Weaver expects K = {weaver.config.K} depths, got logits {tuple(logits.shape)} "
                         f"and h_dflash {tuple(h_dflash.shape)}")
    device, n = logits.device, budget + 1
    pool = min(pool_size or weaver.config.candidate_pool_size, V)
    c = min(children_per_node, pool)
    width = round_width(budget, c)
    check_fillable(budget, width, c, K)
    if implementation is None:
        implementation = "triton_fused" if logits.is_cuda else "torch"
    if implementation not in ROUND_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {ROUND_IMPLEMENTATIONS}, got {implementation!r}")

    # [K, pool]: row d = candidates of depth d + 1, in no particular order (every use re-scores the whole pool;
    # skipping topk's sort of the 512 saves a radix-sort launch per step)
    pool_logits, pool_ids = logits.float().topk(pool, dim=-1, sorted=False)
    cache = weaver.encode_prefix(h_target, h_dflash, n)
    slot_ids = torch.arange(n, device=device)
    tokens = torch.zeros(n, dtype=torch.long, device=device)
    parents = torch.full((n,), -1, dtype=torch.long, device=device)
    depths = torch.zeros(n, dtype=torch.long, device=device)
    scores = torch.zeros(n, device=device)  # path log-prob of every node
    ancestors = torch.zeros(n, n, dtype=torch.bool, device=device)  # inclusive, by slot
    frontier_score = torch.full((n, c), float("-inf"), device=device)  # −inf: not published or consumed
    frontier_token = torch.zeros(n, c, dtype=torch.long, device=device)
    tokens[:1] = root_token.reshape(1)
    ancestors[:1, :1].fill_(True)  # (a Python-scalar setitem would copy from the host: not capturable)

    expand = EXPANSIONS[implementation]
    place = place_nodes_compiled if implementation == "torch" else weaver_round.place_nodes

    def expand_round(nodes: torch.Tensor) -> None:
        expand(nodes, weaver, cache, tokens, depths, ancestors, scores, pool_ids, pool_logits, frontier_score,
               frontier_token)

    expand_round(slot_ids[:1])
    flat_score, flat_token = frontier_score.view(-1), frontier_token.view(-1)
    filled = 1
    while filled < n:  # rounds and widths depend on `budget` only
        w = min(width, n - filled)
        nodes = slot_ids[filled : filled + w]
        place(flat_score, flat_token, tokens, parents, depths, scores, ancestors, nodes, c)
        if filled + w < n:
            expand_round(nodes)
        filled += w
    return tokens, parents, depths
