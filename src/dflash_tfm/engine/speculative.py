"""The speculative decode step, shared by DFLASH, DDTREE and DFLASH_TFM:

    draft (DFlash block) -> tree (chain | DDTree | Weaver) -> verify (one target pass over the tree)
    -> accept (lossless walk) -> commit (caches advance along the accepted path only)

Algorithms differ only in the `propose` callable that turns the drafter's block output into a tree.
"""
from __future__ import annotations

from typing import Callable

import torch

from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.phase_timer import PhaseTimer
from dflash_tfm.engine.sampler import sample
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.accept import accept_tree, target_draws
from dflash_tfm.spec.tree import TreeSpec

# propose(root [1] long, draft_logits [K, V] fp32, draft_hidden [K, H], h_target [H]) -> tokens, parents, depths
Proposer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class SpeculativeDecoder:
    """Owns one request's speculative state: committed length L, root (bonus) token, the target's final
    hidden state at the last committed token, and the drafter's context cache."""

    def __init__(self, runner: ModelRunner, drafter, propose: Proposer, gdn_kernel: str = "chunk") -> None:
        self.runner, self.drafter, self.propose = runner, drafter, propose
        self.model = runner.model
        self.gdn_kernel = gdn_kernel
        self.tap_layers = tuple(drafter.config.target_layer_ids)
        self.max_depth = drafter.config.block_size - 1
        self.timer = PhaseTimer(runner.device)
        self.length = 0
        self.root: torch.Tensor | None = None
        self.h_last: torch.Tensor | None = None

    def phase_seconds(self) -> dict[str, float]:
        return self.timer.collect()

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None) -> int:
        """Target prefill that also feeds the drafter its context features; returns the first token."""
        self.runner.reset()
        self.drafter.reset()
        logits, hidden = self.runner.prefill(
            torch.tensor(prompt_ids, dtype=torch.long), tap_layers=self.tap_layers,
            on_taps=lambda taps, start: self.drafter.append_context(taps, start),
        )
        self.length = len(prompt_ids)
        self.h_last = hidden
        self.root = sample(logits.view(1, -1), params, generator).view(1)
        return int(self.root.item())

    @torch.inference_mode()
    def step(self, params: SamplingParams, generator: torch.Generator | None) -> list[int]:
        """One draft -> tree -> verify -> accept -> commit round; returns the accepted draft tokens and
        the bonus token. Within one tree depth of the cache end it takes a plain decode step instead."""
        L, t = self.length, self.timer
        if L + self.max_depth + 1 > self.runner.max_len:
            logits = self.runner.decode(self.root, L)
            self.root = sample(logits, params, generator).view(1)
            self.length = L + 1
            return [int(self.root.item())]
        with t.phase("draft"):
            draft_logits, draft_hidden = self.drafter.draft(self.root, L)
        with t.phase("tree"):
            tokens, parents, depths = self.propose(self.root, draft_logits[0], draft_hidden[0], self.h_last)
            tree = TreeSpec.build(tokens.view(1, -1), parents.view(1, -1), cache_len=L)
        with t.phase("verify"):
            hidden, taps, saved = self.model.verify(tree, self.runner.cache, L, self.tap_layers, self.gdn_kernel)
            logits = self.model.logits(hidden[0])
            draws = target_draws(logits, params, generator)
            acc = accept_tree(tokens, parents, depths, tree.ancestor_mask()[0], draws, self.max_depth)
        with t.phase("commit"):
            self.model.commit(self.runner.cache, L, tree, saved, acc.accepted.view(1, -1), acc.path.view(1, -1))
            path_host = acc.path.tolist()  # the one host read per step: which tokens were produced
            path = [i for i in path_host if i >= 0]
            index = torch.tensor(path, device=tokens.device)
            self.drafter.append_context([tap[:, index] for tap in taps], L)
            self.h_last = hidden[0, path[-1]]
            self.root = acc.bonus.view(1)
        self.length = L + len(path)
        return tokens[index[1:]].tolist() + [int(acc.bonus)]
