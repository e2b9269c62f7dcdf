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

With an adaptive budget the decoder holds one proposer per candidate size, and each step's size is chosen by a
`BudgetController` from the draft's own estimate of accepted drafts per size, computed inside the draft's graph
and read by the host when the next step begins (by then the draft has usually finished behind the host's work on
the previous tokens). Size 0 is a plain decode step (the runner's decode graph, as fast as autoregressive
decoding) that keeps the token's features for the drafter's context, so drafting can resume at any step. Those
features, and the prompt's, are appended to the drafter's cache only when a draft needs them, in one call: a
request that never drafts costs the drafter nothing.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dflash_tfm.engine.budget import BudgetController
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.phase_graphs import PhaseGraphs
from dflash_tfm.engine.phase_timer import PhaseTimer, fastest_seconds
from dflash_tfm.layers.compile import unfused
from dflash_tfm.layers.linear import skinny_projections
from dflash_tfm.parallel.group import broadcast_object, tp_size
from dflash_tfm.sampling import sample
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.acceptance_estimate import expected_accepted_by_size
from dflash_tfm.spec.accept import accept_tree, expected_accepted, target_draws
from dflash_tfm.tree import TreeSpec

CONTEXT_HOLD_TOKENS = 2048  # context features held for the drafter at most (one prefill chunk's worth)
TreeBuilder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Proposer:
    """build(root [1] long, draft_logits [K, V] fp32, draft_hidden [K, H], h_target [H]) -> tokens, parents,
    depths, each [num_nodes] (static, so the step's shapes never change). kind: "chain" or "tree", which of the
    drafter-side acceptance estimates (`spec.acceptance_estimate`) predicts it. batched: `build` also takes a
    batch's rows at once (root [B], logits [B, K, V], hidden [B, K, H], h_target [B, H] -> [B, num_nodes] each),
    in the launches of one row."""

    build: TreeBuilder
    num_nodes: int
    kind: str = "tree"
    batched: bool = False



class SpeculativeDecoder:
    """Owns one request's speculative state (committed length, root token, the target's final hidden state at
    the last committed token, the drafter's context cache) and the CUDA graphs of the step's phases."""

    def __init__(self, runner: ModelRunner, drafter, proposer: Proposer | dict[int, Proposer],
                 gdn_kernel: str = "chunk", draft_ahead: bool | None = None) -> None:
        """proposer: one proposer, or one per candidate size > 0 (drafts below the root) for an adaptive budget,
        whose sizes also include 0 (a plain decode step) and which `measure_step_times` then sets up. draft_ahead:
        enqueue each step's draft at the end of the previous step, before its host read (default: on CUDA, where
        it keeps the GPU busy across the read; on the CPU every op is synchronous anyway)."""
        adaptive = isinstance(proposer, dict)
        self.proposers = proposer if adaptive else {proposer.num_nodes - 1: proposer}
        self.runner, self.drafter = runner, drafter
        self.budget: BudgetController | None = None
        self._forced_size: int | None = None
        self._sizes = [0] * adaptive + sorted(self.proposers)
        self._estimate_sizes = [(self.proposers[b].kind if b else "chain", b) for b in self._sizes]
        self.model = runner.model
        self.gdn_kernel = gdn_kernel
        self.tap_layers = tuple(drafter.config.target_layer_ids)
        self.block = drafter.config.block_size
        self.max_depth = self.block - 1
        self.timer = PhaseTimer(runner.device)
        self.graphs = PhaseGraphs(runner.use_cuda_graph, per_phase=8 * len(self._sizes))
        self.length = 0  # host copy of the committed length
        self.last_step_drafts = 0  # tokens the last step proposed for verification (0 for a plain decode step)
        device = runner.device
        self._length = torch.zeros(1, dtype=torch.long, device=device)
        # Benchmarks only (`track_expected`, set before the first step): the exact expected accepted drafts of
        # every verified tree, summed over the request on the device (see `expected_drafts`).
        self.track_expected = False
        self._expected_total = torch.zeros((), device=device)
        self._root = torch.zeros(1, dtype=torch.long, device=device)
        self._h_last = torch.zeros(self.model.config.hidden_size, dtype=runner.dtype, device=device)
        self._uniforms = torch.zeros(max(p.num_nodes for p in self.proposers.values()), device=device)
        self._emitted = torch.full((self.block,), -1, dtype=torch.long, device=device)
        self.draft_ahead = runner.device.type == "cuda" if draft_ahead is None else draft_ahead
        self._drafted = False  # the draft outputs already hold the draft of the current state
        cuda = device.type == "cuda"
        self._emitted_host = torch.empty(self.block, dtype=torch.long, pin_memory=cuda)
        self._emitted_copied = torch.cuda.Event() if cuda else None
        self._estimate = torch.zeros(len(self._sizes), device=device)  # E(b) of the latest draft, per size
        self._estimate_host = torch.empty(len(self._sizes), pin_memory=cuda)
        self._estimate_copied = torch.cuda.Event() if cuda else None
        self._predicted = 0.0  # E(b) of the size the current step took
        self._drafts_made = 0
        self._pending_context: list[tuple[torch.Tensor, int]] = []  # (features [1, T, K*H], start) not yet cached
        self._pending_tokens = 0
        # Outputs passed from phase to phase (under CUDA graphs: the tensors the captured graphs write). Tree and
        # verify outputs are kept per size: a replayed graph runs no Python, so a size's commit must read the
        # tensors its own size's graphs write, whichever size ran last.
        self._draft_logits: torch.Tensor | None = None
        self._draft_hidden: torch.Tensor | None = None
        self._trees: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, TreeSpec]] = {}
        self._verified: dict[int, tuple] = {}

    def phase_seconds(self) -> dict[str, float]:
        return self.timer.collect()

    def expected_drafts(self) -> float | None:
        """With `track_expected`: the request's sum over its tree steps of the drafts acceptance takes in
        expectation under the target (`spec.accept.expected_accepted`; free of the draws' noise); else None."""
        return float(self._expected_total) if self.track_expected else None

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None) -> int:
        """Target prefill that also feeds the drafter its context features; returns the first token."""
        self.runner.reset()
        self.drafter.reset()
        if self.budget is not None:
            self.budget.start_request()
        self._drafted = False
        self._pending_context.clear()
        self._pending_tokens = 0
        self._expected_total.zero_()
        logits, hidden = self.runner.prefill(
            torch.tensor(prompt_ids, dtype=torch.long), tap_layers=self.tap_layers,
            on_taps=lambda taps, start: self._defer_context(torch.cat(taps, dim=-1), start),
        )
        self.length = len(prompt_ids)
        self._length.fill_(self.length)
        self._h_last.copy_(hidden)
        self._root.copy_(sample(logits.view(1, -1), params, generator).view(1))
        return int(self._root.item())

    @torch.inference_mode()
    def step(self, params: SamplingParams, generator: torch.Generator | None) -> list[int]:
        """One draft -> tree -> verify -> commit round; returns the accepted draft tokens and the bonus token.
        Within one tree depth of the cache end, or when an adaptive budget chooses size 0, a plain decode step."""
        L = self.length
        if L + self.max_depth + 1 > self.runner.max_len:
            self.last_step_drafts = 0
            logits = self.runner.decode(self._root, L)
            self._root.copy_(sample(logits, params, generator).view(1))
            self.length = L + 1
            return [int(self._root.item())]
        start, drafts = time.perf_counter(), self._drafts_made
        with skinny_projections():  # fixed row counts: projections may take their tuned kernels
            size = self._choose_size(L)
            self.last_step_drafts = size
            if size == 0:
                emitted = self._decode_step(L, params, generator)
            else:
                emitted = self._tree_step(L, size, params, generator)
        if self.budget is not None and self._forced_size is None:
            self.budget.observe(size, self._predicted, len(emitted) - 1)
            if tp_size() == 1:  # tensor-parallel ranks keep rank 0's start-up times: their choices must agree
                # T(size) counts the next step's draft for a tree step and no draft for a decode step: correct
                # the wall time by the drafts this step made beyond that
                extra = self._drafts_made - drafts - (1 if size else 0)
                self.budget.observe_seconds(size, time.perf_counter() - start - extra * self.budget.draft_seconds)
        return emitted

    def _tree_step(self, L: int, size: int, params: SamplingParams, generator: torch.Generator | None) -> list[int]:
        """Tree (of the size's proposer) -> verify -> commit on the current draft."""
        if not params.greedy:
            self._uniforms.uniform_(generator=generator)
        sampling = "greedy" if params.greedy else (params.temperature, params.top_k, params.top_p)
        t = self.timer
        with t.phase("tree"):
            self.graphs.run(("tree", size), lambda: self._tree(size))
        with t.phase("verify"):
            self.graphs.run(("verify", size), lambda: self._verify(size))
        with t.phase("commit"):
            self.graphs.run(("commit", sampling, size, self.track_expected), lambda: self._commit(params, size),
                            advances_state=True)
            self._stage_emitted()
        # The next step's draft, for a committed length of at most L + block: enqueued before the read.
        self._drafted = (self.draft_ahead and L + self.block + self.max_depth + 1 <= self.runner.max_len
                         and self._next_step_drafts())
        if self._drafted:
            self._timed_draft(L + self.block)
        return self._take_emitted(staged=True)  # the one host read per step: which tokens were produced

    def _decode_step(self, L: int, params: SamplingParams, generator: torch.Generator | None) -> list[int]:
        """Size 0: the runner's decode step at L, whose tap-layer outputs extend the drafter's context."""
        with self.timer.phase("verify"):
            logits, hidden, taps = self.runner.decode_with_taps(self._root, L, self.tap_layers)
            token = sample(logits, params, generator).view(1)
        with self.timer.phase("commit"):
            self._defer_context(torch.cat(taps, dim=-1), L)  # a copy: the graph's taps are reused
            self._h_last.copy_(hidden)
            self._root.copy_(token)
            self._length.add_(1)
        self.length = L + 1
        self._drafted = (self.draft_ahead and L + 1 + self.max_depth + 1 <= self.runner.max_len
                         and self._next_step_drafts())
        if self._drafted:
            self._timed_draft(L + 1)
        return [int(token.item())]

    def _next_step_drafts(self) -> bool:
        if self._forced_size is not None:
            return self._forced_size > 0
        return self.budget is None or self.budget.wants_draft()

    def _choose_size(self, length: int) -> int:
        """The size of this step. With one proposer: its size (drafting now unless drafted ahead). Adaptive:
        draft when the controller wants a draft, then let it choose from the draft's estimates."""
        if self.budget is None and self._forced_size is None:
            if not self._drafted:
                self._timed_draft(length)
            return self._sizes[0]
        if not self._drafted and self._next_step_drafts():
            self._timed_draft(length)
            self._drafted = True
        if self._forced_size is not None:
            return self._forced_size
        estimate = self._read_estimate() if self._drafted else None
        size = self.budget.choose(estimate)
        self._predicted = estimate[self._sizes.index(size)] if estimate is not None else 0.0
        return size

    def _read_estimate(self) -> list[float]:
        if self._estimate_copied is not None:
            self._estimate_copied.synchronize()
        return self._estimate_host.tolist()

    @torch.inference_mode()
    def measure_step_times(self, prompt_ids: list[int], warmup: int = 1, steps: int = 3) -> dict[int, float]:
        """Seconds per step at each candidate size, as `step` runs them (graphs captured and warmed first), over
        a throwaway greedy request on `prompt_ids`; from then on the adaptive budget decides with these times.
        Leaves no state a later `prefill` does not reset."""
        times = {size: self._run_at_size(size, prompt_ids, SamplingParams(), warmup, steps) for size in self._sizes}
        self._timed_draft(self.length)  # what one probe costs: a draft, timed alone
        draft = self.timer.collect().get("draft", 0.0)
        # Tensor-parallel ranks decide with rank 0's times, so they choose the same sizes and their collectives meet.
        times, draft = broadcast_object((times, draft))
        self.budget = BudgetController(self._sizes, times, draft_seconds=draft)
        return times

    @torch.inference_mode()
    def warm_up_sizes(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        """One step at every candidate size with these sampling settings, so each size's graphs for them are
        captured before anything is timed (`measure_step_times` captures the greedy ones)."""
        for size in self._sizes:
            self._run_at_size(size, prompt_ids, params, warmup=1, steps=0, generator=generator)

    def _run_at_size(self, size: int, prompt_ids: list[int], params: SamplingParams, warmup: int, steps: int,
                     generator: torch.Generator | None = None) -> float:
        """The fastest of `steps` steps forced to `size` (seconds) after `warmup` steps, on a fresh request: the
        minimum, since other work on the machine only ever adds time."""
        self._forced_size = size
        try:
            self.prefill(prompt_ids, params, generator)
            return fastest_seconds(lambda: self.step(params, generator), warmup, steps, self.runner.device)
        finally:
            self._forced_size = None
            self.timer.collect()

    def _timed_draft(self, max_length: int) -> None:
        """The draft phase for a committed length of at most ``max_length`` (its graph reads a power-of-two
        bucket of drafter slots >= max_length + block)."""
        draft_len = self.runner.bucket(max_length + self.max_depth)
        self._drafts_made += 1
        with self.timer.phase("draft"):
            self._flush_context()
            self.graphs.run(("draft", draft_len), lambda: self._draft(draft_len))
        if len(self._sizes) > 1:  # start the estimate's copy to the host; `_read_estimate` waits for it
            self._estimate_host.copy_(self._estimate, non_blocking=self._estimate_copied is not None)
            if self._estimate_copied is not None:
                self._estimate_copied.record()

    def _defer_context(self, feats: torch.Tensor, start: int) -> None:
        """Hold context features [1, T, K*H] of positions start.. until a draft needs them; beyond
        `CONTEXT_HOLD_TOKENS` held (a long prompt) they are appended at once, so holding never costs more memory
        than a prefill chunk's features."""
        self._pending_context.append((feats, start))
        self._pending_tokens += feats.shape[1]
        if self._pending_tokens >= CONTEXT_HOLD_TOKENS:
            self._flush_context()

    def _flush_context(self) -> None:
        """Append the held context features to the drafter's cache, contiguous spans as one call."""
        spans: list[tuple[list[torch.Tensor], int, int]] = []  # (parts, start, end)
        for feats, start in self._pending_context:
            if spans and spans[-1][2] == start:
                parts, first, _ = spans[-1]
                parts.append(feats)
                spans[-1] = (parts, first, start + feats.shape[1])
            else:
                spans.append(([feats], start, start + feats.shape[1]))
        # One token (a decode step's) is the shape every step repeats: compiled. Longer spans (a prompt, the tokens
        # of several decode steps between drafts) have lengths that vary: eagerly, as the prompt's prefill runs.
        with unfused() if self._pending_tokens > 1 else contextlib.nullcontext():
            for parts, start, _ in spans:
                self.drafter.append_context(torch.cat(parts, dim=1), start)
        self._pending_context.clear()
        self._pending_tokens = 0

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
        if len(self._sizes) > 1:
            self._estimate.copy_(expected_accepted_by_size(logits[0], self._estimate_sizes))

    def _tree(self, size: int) -> None:
        build = self.proposers[size].build
        tokens, parents, depths = build(self._root, self._draft_logits, self._draft_hidden, self._h_last)
        tree = TreeSpec.build(tokens.view(1, -1), parents.view(1, -1), cache_len=self._length)
        self._trees[size] = (tokens, parents, depths, tree)

    def _verify(self, size: int) -> None:
        tree = self._trees[size][3]
        # Without graphs the committed length is known on the host: attention then reads only the cache's used
        # slots (a CPU's reference attention would read all of them); a captured graph reads the device length.
        length = self._length if self.graphs.enabled else self.length
        hidden, taps, saved = self.model.verify(tree, self.runner.cache, length, self.tap_layers, self.gdn_kernel)
        self._verified[size] = (hidden[0], taps, saved, self.model.logits(hidden[0]))

    def _commit(self, params: SamplingParams, size: int) -> None:
        """Accept along the target's draws, commit the path to the target and drafter caches, advance
        L / root / h_last, and write the emitted tokens (accepted drafts then the bonus, -1 padded). Any draft
        made before is of the old state now (`step` enqueues the next one after this)."""
        self._drafted = False
        tokens, parents, depths, tree = self._trees[size]
        hidden, taps, saved, logits = self._verified[size]
        draws = target_draws(logits, params, self._uniforms)
        acc = accept_tree(tokens, parents, depths, tree.ancestor_mask()[0], draws, self.max_depth)
        if self.track_expected:
            self._expected_total.add_(expected_accepted(logits, tokens, parents, tree.ancestor_mask()[0], params))
        self.model.commit(self.runner.cache, self._length, tree, saved, acc.accepted.view(1, -1), acc.path.view(1, -1))
        self.drafter.append_context(torch.cat(taps, dim=-1)[:, acc.path_or_last()], self._length)  # one gather
        self._emitted.copy_(acc.emitted(tokens))
        self._h_last.copy_(hidden.index_select(0, acc.last.view(1))[0])
        self._root.copy_(acc.bonus.view(1))
        self._length.add_((acc.path >= 0).sum())
