"""Builds the decoder an `Engine` runs: autoregressive, or speculative with one of three tree proposers.

    DFLASH      chain of the drafter's per-depth argmax (block - 1 drafted tokens)
    DDTREE      best-first tree over the product of the drafter's marginals (budget + 1 nodes)
    DFLASH_TFM  Weaver-rescored best-first tree (budget + 1 nodes); the chain when budget + 1 <= block size
"""
from __future__ import annotations

from pathlib import Path

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.autoregressive import AutoregressiveDecoder
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.speculative import Proposer, SpeculativeDecoder
from dflash_tfm.spec.weaver_tree import DEFAULT_CHILDREN_PER_NODE, build_weaver_tree

SPECULATIVE_ALGORITHMS = ("DFLASH", "DDTREE", "DFLASH_TFM")


def normalize_algorithm(name: str | None) -> str | None:
    """None / "NONE" -> None; otherwise the upper-case name, validated."""
    if name is None or str(name).upper() == "NONE":
        return None
    algo = str(name).upper()
    if algo not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"unknown speculative_algorithm {name!r}; choose None or one of {', '.join(SPECULATIVE_ALGORITHMS)}")
    return algo


def build_decoder(
    runner: ModelRunner, cfg: ModelConfig, algorithm: str | None, draft_model_path: str | Path | None,
    weaver_path: str | Path | None, tree_budget: int, block_size: int | None, gdn_kernel: str,
    children_per_node: int = DEFAULT_CHILDREN_PER_NODE,
) -> AutoregressiveDecoder | SpeculativeDecoder:
    algo = normalize_algorithm(algorithm)
    if algo is None:
        return AutoregressiveDecoder(runner)
    if draft_model_path is None:
        raise ValueError(f"speculative_algorithm={algo} needs draft_model_path (a DFlash drafter directory)")
    if tree_budget < 1:
        raise ValueError(f"tree_budget must be >= 1, got {tree_budget}")
    from dflash_tfm.spec.dflash import load_dflash_drafter

    model = runner.model
    # The drafter writes its block's K/V as scratch after the context: room for a block past the last position.
    drafter = load_dflash_drafter(
        draft_model_path, model, cfg, runner.device, runner.dtype, max_len=runner.max_len + 64,
    )
    block = drafter.config.block_size
    if block_size is not None and block_size != block:
        raise ValueError(f"block_size {block_size} does not match the drafter's block_size {block} ({draft_model_path})")
    proposer = build_proposer(algo, runner, cfg, weaver_path, tree_budget, block, children_per_node)
    return SpeculativeDecoder(runner, drafter, proposer, gdn_kernel)


def build_proposer(
    algo: str, runner: ModelRunner, cfg: ModelConfig, weaver_path, budget: int, block: int,
    children_per_node: int = DEFAULT_CHILDREN_PER_NODE,
) -> Proposer:
    from dflash_tfm.spec.chain import build_chain

    chain = Proposer(lambda root, logits, hidden, h_target: build_chain(root, logits), num_nodes=block)
    if algo == "DFLASH":
        return chain
    if algo == "DDTREE":
        from dflash_tfm.spec.ddtree import build_ddtree

        return Proposer(lambda root, logits, hidden, h_target: build_ddtree(root, logits, budget), num_nodes=budget + 1)
    if weaver_path is None:
        raise ValueError("speculative_algorithm=DFLASH_TFM needs weaver_path (a Weaver .pth checkpoint)")
    from dflash_tfm.spec.weaver import load_weaver

    weaver = load_weaver(weaver_path, runner.model, cfg, block, runner.device, runner.dtype)
    if budget + 1 <= block:  # a tree no larger than the block: the chain is at least as good
        return chain
    if children_per_node < 1:
        raise ValueError(f"children_per_node must be >= 1, got {children_per_node}")
    return Proposer(lambda root, logits, hidden, h_target: build_weaver_tree(
        weaver, root, logits, hidden, h_target, budget, children_per_node=children_per_node), num_nodes=budget + 1)
