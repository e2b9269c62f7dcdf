"""Builds the decoder an `Engine` runs: autoregressive, or speculative with one of three tree proposers.

    DFLASH      chain of the drafter's per-depth argmax (block - 1 drafted tokens)
    DDTREE      best-first tree over the product of the drafter's marginals (budget + 1 nodes)
    DFLASH_TFM  Weaver-rescored best-first tree (budget + 1 nodes); the chain when budget + 1 <= block size
"""
from __future__ import annotations

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.autoregressive import AutoregressiveDecoder
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.speculative import Proposer, SpeculativeDecoder
from dflash_tfm.spec.chain import build_chain
from dflash_tfm.spec.ddtree import build_ddtree
from dflash_tfm.spec.dflash import load_dflash_drafter
from dflash_tfm.spec.weaver import load_weaver
from dflash_tfm.spec.weaver_tree import build_weaver_tree
from dflash_tfm.speculative_config import SpeculativeConfig


def build_decoder(runner: ModelRunner, cfg: ModelConfig,
                  spec: SpeculativeConfig) -> AutoregressiveDecoder | SpeculativeDecoder:
    """The decoder `spec` describes; its checkpoint paths must be set (`SpeculativeConfig.with_checkpoints`)."""
    if not spec.enabled:
        return AutoregressiveDecoder(runner)
    spec = spec.with_checkpoints()
    # The drafter writes its block's K/V as scratch after the context: room for a block past the last position.
    drafter = load_dflash_drafter(
        spec.draft_model_path, runner.model, cfg, runner.device, runner.dtype, max_len=runner.max_len + 64,
    )
    block = drafter.config.block_size
    if spec.block_size is not None and spec.block_size != block:
        raise ValueError(f"block_size {spec.block_size} (--speculative-dflash-block-size) does not match the "
                         f"drafter's block_size {block} ({spec.draft_model_path})")
    return SpeculativeDecoder(runner, drafter, build_proposer(spec, runner, cfg, block), spec.gdn_verify_kernel)


def build_proposer(spec: SpeculativeConfig, runner: ModelRunner, cfg: ModelConfig, block: int) -> Proposer:
    chain = Proposer(lambda root, logits, hidden, h_target: build_chain(root, logits), num_nodes=block)
    budget = spec.tree_budget
    if spec.algorithm == "DFLASH":
        return chain
    if spec.algorithm == "DDTREE":
        return Proposer(lambda root, logits, hidden, h_target: build_ddtree(root, logits, budget), num_nodes=budget + 1)
    weaver = load_weaver(spec.weaver_path, runner.model, cfg, block, runner.device, runner.dtype)
    if budget + 1 <= block:  # a tree no larger than the block: the chain is at least as good
        return chain
    return Proposer(lambda root, logits, hidden, h_target: build_weaver_tree(
        weaver, root, logits, hidden, h_target, budget, children_per_node=spec.children_per_node), num_nodes=budget + 1)
