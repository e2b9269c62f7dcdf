"""The speculative decode step, shared by DFLASH, DDTREE and DFLASH_TFM:

    draft (DFlash block) -> tree (chain | DDTree | Weaver) -> verify (one target pass over the tree)
    -> commit (lossless acceptance walk; caches advance along the accepted path only)

Algorithms differ only in the `Proposer` that turns the drafter's block output into a tree. Every phase reads
and writes device tensors only: the committed length L, the root (bonus) token and the target's hidden state
at the last committed token live in static buffers, the drafter's context append always writes a full
block of slots (the ones past the accepted path are scratch the next draft overwrites), and sampling reads
uniforms drawn before the step. So on CUDA each phase is one graph replay (`PhaseGraphs`), and the step's
only host synchronisation is reading the tokens it produced. That read overlaps the next step's draft: the draft
needs only device state the commit just wrote (and a key-length bound the host knows before the read), so it is
enqueued first and the GPU does not idle while the host reads tokens and returns to the next step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.phase_graphs import PhaseGraphs
from dflash_tfm.engine.phase_timer import PhaseTimer
from dflash_tfm.sampling import sample
from dflash_tfm.layers.linear import skinny_projections
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.accept import accept_tree, target_draws
from dflash_tfm.tree import TreeSpec

TreeBuilder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Proposer:
    """build(root [1] long, draft_logits [K, V] fp32, draft_hidden [K, H], h_target [H]) -> tokens, parents,
    depths, each [num_nodes] (static, so the step's shapes never change)."""

    build: TreeBuilder
    num_nodes: int


class SpeculativeDecoder:
    """Owns one request's speculative state (committed length, root token, the target's final hidden state at
    the last committed token, the drafter's context cache) and the CUDA graphs of the step's phases."""

    def __init__(self, runner: ModelRunner, drafter, proposer: Proposer, gdn_kernel: str = "chunk",
                 draft_ahead: bool | None = None) -> None:
        """draft_ahead: enqueue each step's draft at the end of the previous step, before its host read (default:
        on CUDA, where it keeps the GPU busy across the read; on the CPU every op is synchronous anyway)."""
        self.runner, self.drafter, self.proposer = runner, drafter, proposer
        self.model = runner.model
        self.gdn_kernel = gdn_kernel
        self.tap_layers = tuple(drafter.config.target_layer_ids)
        self.block = drafter.config.block_size
        self.max_depth = self.block - 1
        self.timer = PhaseTimer(runner.device)
        self.graphs = PhaseGraphs(runner.use_cuda_graph)
        self.length = 0  # host copy of the committed length
        self.last_step_drafts = 0  # tokens the last step proposed for verification (0 for a plain decode step)
        device = runner.device
        self._length = torch.zeros(1, dtype=torch.long, device=device)
        self._root = torch.zeros(1, dtype=torch.long, device=device)
        self._h_last = torch.zeros(self.model.config.hidden_size, dtype=runner.dtype, device=device)
        self._uniforms = torch.zeros(proposer.num_nodes, device=device)
        self._emitted = torch.full((self.block,), -1, dtype=torch.long, device=device)
        self._steps = torch.arange(self.block, device=device)
        self.draft_ahead = runner.device.type == "cuda" if draft_ahead is None else draft_ahead
        self._drafted = False  # the draft outputs already hold the draft of the current state
        cuda = device.type == "cuda"
        self._emitted_host = torch.empty(self.block, dtype=torch.long, pin_memory=cuda)
        self._emitted_copied = torch.cuda.Event() if cuda else None
        # Outputs passed from phase to phase (under CUDA graphs: the tensors the captured graphs write).
        self._draft_logits: torch.Tensor | None = None
        self._draft_hidden: torch.Tensor | None = None
        self._tree_nodes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._tree_spec: TreeSpec | None = None
        self._verified: tuple | None = None

    def phase_seconds(self) -> dict[str, float]:
        return self.timer.collect()

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None) -> int:
        """Target prefill that also feeds the drafter its context features; returns the first token."""
        self.runner.reset()
        self.drafter.reset()
        self._drafted = False
        logits, hidden = self.runner.prefill(
            torch.tensor(prompt_ids, dtype=torch.long), tap_layers=self.tap_layers,
            on_taps=lambda taps, start: self.drafter.append_context(taps, start),
        )
        self.length = len(prompt_ids)
        self._length.fill_(self.length)
        self._h_last.copy_(hidden)
        self._root.copy_(sample(logits.view(1, -1), params, generator).view(1))
        return int(self._root.item())

    @torch.inference_mode()
    def step(self, params: SamplingParams, generator: torch.Generator | None) -> list[int]:
        """One draft -> tree -> verify -> commit round; returns the accepted draft tokens and the bonus token.
        Within one tree depth of the cache end it takes a plain decode step instead."""
        L, t = self.length, self.timer
        if L + self.max_depth + 1 > self.runner.max_len:
            self.last_step_drafts = 0
            logits = self.runner.decode(self._root, L)
            self._root.copy_(sample(logits, params, generator).view(1))
            self.length = L + 1
            return [int(self._root.item())]
        if not params.greedy:
            self._uniforms.uniform_(generator=generator)
        self.last_step_drafts = self.proposer.num_nodes - 1
        sampling = "greedy" if params.greedy else (params.temperature, params.top_k, params.top_p)
        with skinny_projections():  # fixed row counts: projections may take their tuned kernels
            if not self._drafted:
                self._timed_draft(L)
            with t.phase("tree"):
                self.graphs.run(("tree",), self._tree)
            with t.phase("verify"):
                self.graphs.run(("verify",), self._verify)
            with t.phase("commit"):
                self.graphs.run(("commit", sampling), lambda: self._commit(params), advances_state=True)
                self._stage_emitted()
            # The next step's draft, for a committed length of at most L + block: enqueued before the read.
            self._drafted = self.draft_ahead and L + self.block + self.max_depth + 1 <= self.runner.max_len
            if self._drafted:
                self._timed_draft(L + self.block)
            return self._take_emitted(staged=True)  # the one host read per step: which tokens were produced

    def _timed_draft(self, max_length: int) -> None:
        """The draft phase for a committed length of at most ``max_length`` (its graph reads a power-of-two
        bucket of drafter slots >= max_length + block)."""
        draft_len = self.runner.bucket(max_length + self.max_depth)
        with self.timer.phase("draft"):
            self.graphs.run(("draft", draft_len), lambda: self._draft(draft_len))

    def _stage_emitted(self) -> None:
        """Start copying the last commit's tokens to the host (pinned memory on CUDA), without waiting."""
        self._emitted_host.copy_(self._emitted, non_blocking=self._emitted_copied is not None)
        if self._emitted_copied is not None:
            self._emitted_copied.record()

    def _take_emitted(self, staged: bool = False) -> list[int]:
        """The tokens the last commit produced (waits for their copy only, not for work enqueued after it; the
        copy is started here unless `_stage_emitted` already did) and the committed length advanced."""
        if not staged:
            self._stage_emitted()
        if self._emitted_copied is not None:
            self._emitted_copied.synchronize()
        emitted = self._emitted_host.tolist()
        out = emitted[: emitted.index(-1)] if -1 in emitted else emitted
        self.length += len(out)
        return out

    # ---- phases: device tensors in, device tensors out -----------------------------------------------
    def _draft(self, kv_len: int) -> None:
        logits, hidden = self.drafter.draft(self._root, self._length, kv_len)
        if self._draft_logits is None:
            self._draft_logits, self._draft_hidden = torch.empty_like(logits[0]), torch.empty_like(hidden[0])
        self._draft_logits.copy_(logits[0])
        self._draft_hidden.copy_(hidden[0])

    def _tree(self) -> None:
        tokens, parents, depths = self.proposer.build(self._root, self._draft_logits, self._draft_hidden, self._h_last)
        self._tree_nodes = (tokens, parents, depths)
        self._tree_spec = TreeSpec.build(tokens.view(1, -1), parents.view(1, -1), cache_len=self._length)

    def _verify(self) -> None:
        hidden, taps, saved = self.model.verify(self._tree_spec, self.runner.cache, self._length, self.tap_layers,
                                                self.gdn_kernel)
        self._verified = (hidden[0], taps, saved, self.model.logits(hidden[0]))

    def _commit(self, params: SamplingParams) -> None:
        """Accept along the target's draws, commit the path to the target and drafter caches, advance
        L / root / h_last, and write the emitted tokens (accepted drafts then the bonus, -1 padded). Any draft
        made before is of the old state now (`step` enqueues the next one after this)."""
        self._drafted = False
        tokens, parents, depths = self._tree_nodes
        tree, (hidden, taps, saved, logits) = self._tree_spec, self._verified
        draws = target_draws(logits, params, self._uniforms)
        acc = accept_tree(tokens, parents, depths, tree.ancestor_mask()[0], draws, self.max_depth)
        self.model.commit(self.runner.cache, self._length, tree, saved, acc.accepted.view(1, -1), acc.path.view(1, -1))
        on_path = torch.where(acc.path >= 0, acc.path, acc.last)  # padding repeats the last node: scratch slots
        self.drafter.append_context(torch.cat(taps, dim=-1)[:, on_path], self._length)  # one gather for all taps
        count = (acc.path >= 0).sum()
        after = torch.cat([acc.path[1:], acc.path[:1].new_full((1,), -1)])  # the node after each path node
        emitted = torch.where(after >= 0, tokens[after.clamp(min=0)], -1)
        self._emitted.copy_(torch.where(self._steps == count - 1, acc.bonus, emitted))
        self._h_last.copy_(hidden.index_select(0, acc.last.view(1))[0])
        self._root.copy_(acc.bonus.view(1))
        self._length.add_(count)
