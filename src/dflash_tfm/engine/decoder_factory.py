"""Builds the decoder an `Engine` runs: autoregressive, or speculative with one of three tree proposers.

    DFLASH      chain of the drafter's per-depth argmax (block - 1 drafted tokens)
    DDTREE      best-first tree over the product of the drafter's marginals (budget + 1 nodes)
    DFLASH_TFM  Weaver-rescored best-first tree (budget + 1 nodes); the chain when budget + 1 <= block size

With tree_budget "auto" the decoder gets one proposer per candidate size and picks one per step
(`engine.budget`).
"""
from __future__ import annotations

import torch

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


# Candidate sizes of an adaptive budget (drafts verified below the root; 0: a plain decode step). Trees above 128
# nodes are not offered: the tree kernels are tested up to 129 nodes. On a CPU a verify costs about its node
# count in compute, so the large sizes could only lose there.
ADAPTIVE_TREE_SIZES = {"cuda": (0, 8, 16, 32, 64, 128), "cpu": (0, 8, 16, 32, 64)}
ADAPTIVE_CHAIN_SIZES = (0, 3, 7, 15)  # capped at the drafter's block - 1
CALIBRATION_PROMPT_TOKENS = 64


def build_decoder(runner: ModelRunner, cfg: ModelConfig, spec: SpeculativeConfig,
                  drafter_rows: int = 1) -> AutoregressiveDecoder | SpeculativeDecoder:
    """The decoder `spec` describes; its checkpoint paths must be set (`SpeculativeConfig.with_checkpoints`).
    With an adaptive budget the step time of every candidate size is measured here, on this machine.
    drafter_rows: context-cache rows of the drafter (a `SpeculativeBatch` shares it; the decoder uses row 0)."""
    if not spec.enabled:
        return AutoregressiveDecoder(runner)
    spec = spec.with_checkpoints()
    # The drafter writes its block's K/V as scratch after the context: room for a block past the last position.
    drafter = load_dflash_drafter(
        spec.draft_model_path, runner.model, cfg, runner.device, runner.dtype, max_len=runner.max_len + 64,
        batch=drafter_rows,
    )
    block = drafter.config.block_size
    if spec.block_size is not None and spec.block_size != block:
        raise ValueError(f"block_size {spec.block_size} (--speculative-dflash-block-size) does not match the "
                         f"drafter's block_size {block} ({spec.draft_model_path})")
    if not spec.adaptive:
        return SpeculativeDecoder(runner, drafter, build_proposer(spec, runner, cfg, block), spec.gdn_verify_kernel)
    decoder = SpeculativeDecoder(runner, drafter, build_proposers(spec, runner, cfg, block), spec.gdn_verify_kernel)
    # Every measured step must be a real one (within a tree's depth of the cache end a step is a plain decode):
    # room for the prompt, each step's block and the final probe's draft; a small cache measures fewer steps.
    warmup = 1
    steps = min(2 if runner.device.type == "cpu" else 10, (runner.max_len - 1) // block - 2 - warmup)
    if steps < 1:
        raise ValueError(f"tree_budget 'auto' measures each proposal size over a few steps of {block} tokens, which "
                         f"needs max_model_len >= {4 * block + 1}; got {runner.max_len}: raise max_model_len or give "
                         "a fixed tree budget")
    prompt_tokens = min(CALIBRATION_PROMPT_TOKENS, runner.max_len - (warmup + steps + 2) * block)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    decoder.measure_step_times(prompt.tolist(), warmup=warmup, steps=steps)
    return decoder


def build_proposers(spec: SpeculativeConfig, runner: ModelRunner, cfg: ModelConfig, block: int) -> dict[int, Proposer]:
    """One proposer per candidate size > 0 of an adaptive budget (the decoder adds size 0, a plain decode step)."""
    if spec.algorithm == "DFLASH":
        sizes = [b for b in ADAPTIVE_CHAIN_SIZES if b <= block - 1]
    else:
        sizes = list(ADAPTIVE_TREE_SIZES["cpu" if runner.device.type == "cpu" else "cuda"])
    weaver = None
    if spec.algorithm == "DFLASH_TFM":
        weaver = load_weaver(spec.weaver_path, runner.model, cfg, block, runner.device, runner.dtype)
    return {b: _proposer(spec.algorithm, b, block, weaver, spec.children_per_node) for b in sizes if b > 0}


def build_proposer(spec: SpeculativeConfig, runner: ModelRunner, cfg: ModelConfig, block: int) -> Proposer:
    """The proposer of a fixed budget (DFLASH: the drafter's whole chain)."""
    weaver = None
    if spec.algorithm == "DFLASH_TFM":
        weaver = load_weaver(spec.weaver_path, runner.model, cfg, block, runner.device, runner.dtype)
    size = spec.tree_budget
    if spec.algorithm == "DFLASH" or (spec.algorithm == "DFLASH_TFM" and size + 1 <= block):  # the whole chain
        size = block - 1
    return _proposer(spec.algorithm, size, block, weaver, spec.children_per_node)


def _proposer(algorithm: str, size: int, block: int, weaver, children_per_node: int) -> Proposer:
    """`size` drafts below the root: a chain (DFLASH; DFLASH_TFM when the tree would be no larger than the block,
    where the chain is at least as good), DDTREE's best-first tree, or a Weaver-grown tree."""
    if algorithm == "DFLASH" or (algorithm == "DFLASH_TFM" and size + 1 <= block):
        return Proposer(lambda root, logits, hidden, h_target: build_chain(root, logits[..., :size, :]),
                        num_nodes=size + 1, kind="chain", batched=True)
    if algorithm == "DDTREE":
        return Proposer(lambda root, logits, hidden, h_target: build_ddtree(root, logits, size), num_nodes=size + 1,
                        batched=True)
    depth = weaver.config.K  # min(block - 1, the Weaver's K): a Weaver trained for shallower trees reads fewer depths
    return Proposer(lambda root, logits, hidden, h_target: build_weaver_tree(
        weaver, root, logits[:depth], hidden[:depth], h_target, size, children_per_node=children_per_node),
        num_nodes=size + 1)
