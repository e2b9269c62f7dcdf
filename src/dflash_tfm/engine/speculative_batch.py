"""Continuous batching of speculative decoding: many requests, one drafter pass and one target verify per step.

Why: while the target is weight-bound, verifying the trees of several sequences in one forward costs little more
than verifying one, so a server with speculative decoding should not make its clients take turns. Each running
request owns one row (slot) of the target's cache (`BatchRunner`) and of the drafter's context cache
(`DFlashDrafter.allocate(..., batch=slots)`). A `step`:

1. feeds one chunk (`prefill_chunk` tokens) of the oldest newcomer's prompt into its rows, and once its prompt
   is all in draws its first token, so a long prompt holds the running requests up for one chunk per step;
2. drafts every row of the step's batch bucket in one drafter pass, each row at its own length;
3. builds one tree per row with the proposer (row by row: the builders are batch-1);
4. verifies all trees in ONE target forward (tree attention and the Gated-DeltaNet tree kernels take a batch
   with one committed length per row);
5. accepts each row along its own target draws, with its request's own sampling settings and generator (the
   uniforms are drawn from it in the same order as when the request decodes alone, so at a fixed budget a
   request's tokens do not depend on which others share its steps; with ``auto`` the sizes do, and a sampled
   request's draws with them, each as lossless as the other), and commits every decoding row's path in one
   call; a row that is not decoding (still in its prompt, or holding no request) accepts nothing, not even its root
   (`Acceptance.only`), so the commit leaves its Gated-DeltaNet state, conv window and length as they were, and
   what its throwaway tree wrote past its length is overwritten by its next prompt chunk;
6. reads the produced tokens of every row at once (one host read) and pushes them through each request's stop
   conditions.

Rows of the bucket that hold no request run a throwaway tree too. The caches carry `TREE_SLACK` positions beyond
the context so a request can decode to the last position of its context with a whole tree.

The proposal size is the engine's fixed tree budget, or with ``auto`` chosen before every step for the whole
batch (one verify shape) by the adaptive budget of the step's batch bucket (`engine.budget`, one
`BudgetController` per bucket): its step times T(b) are measured per bucket (`measure_step_times`), so as the
batch grows and verifying B trees gets dearer than one plain batched decode step, it takes smaller trees and at
worst size 0, a plain decode step of every row (a tree of the root alone); its acceptance estimate is the mean
over the step's requests of their drafts' estimates, and it learns from their mean accepted drafts. Sizes change
between steps only, so every row's acceptance stays lossless.

On CUDA steps 2–5 are four CUDA graphs (`PhaseGraphs`), as in the one-request decoder: draft per (batch bucket,
drafter key-length bucket), tree and verify per batch bucket, commit per batch bucket and the sampling settings of
its rows (a sampled row's settings are constants of the graph; its uniforms are drawn eagerly into a static
buffer first). Every phase reads and writes per-bucket buffers that live as long as the batch, so a replayed
graph finds its inputs where it captured them. Without graphs (the CPU) the same phases run eagerly.
"""
from __future__ import annotations

import time

import torch

from dflash_tfm.engine.batch_runner import BatchRunner, batch_bucket
from dflash_tfm.engine.budget import BudgetController
from dflash_tfm.engine.batch_slots import BatchSlots
from dflash_tfm.engine.model_runner import key_length_bucket, prefill_in_chunks
from dflash_tfm.engine.phase_graphs import PhaseGraphs
from dflash_tfm.engine.phase_timer import fastest_seconds
from dflash_tfm.engine.sequence import Sequence, StreamDelta
from dflash_tfm.engine.speculative import Proposer
from dflash_tfm.layers.linear import skinny_projections
from dflash_tfm.parallel.group import broadcast_object, tp_size
from dflash_tfm.sampling import sample
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.acceptance_estimate import expected_accepted_by_size
from dflash_tfm.spec.accept import accept_tree, target_draws
from dflash_tfm.tree import TreeSpec

TREE_SLACK = 64  # cache positions past the context: the deepest tree a drafter block (<= 64) can propose


class SpeculativeBatch(BatchSlots):
    def __init__(self, runner: BatchRunner, drafter, proposer: Proposer | dict[int, Proposer], max_len: int,
                 prefill_chunk: int = 2048) -> None:
        """runner: the target's rows (`max_len` + `TREE_SLACK` positions each); drafter: its context caches with
        at least `runner.slots` rows; proposer: the tree every row builds, or one per candidate size > 0 for an
        adaptive budget (sizes then include 0; `measure_step_times` sets it up); max_len: the context a request
        may fill (`Sequence.budget` keeps it there)."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if runner.max_len < max_len + drafter.config.block_size or drafter.batch < runner.slots:
            raise ValueError(f"the batch needs {runner.slots} drafter rows and target rows of >= "
                             f"{max_len + drafter.config.block_size} positions (max_len + a tree)")
        super().__init__(runner)
        adaptive = isinstance(proposer, dict)
        self.drafter = drafter
        self.proposers = proposer if adaptive else {proposer.num_nodes - 1: proposer}
        self.sizes = [0] * adaptive + sorted(self.proposers)
        self._estimate_sizes = [(self.proposers[b].kind if b else "chain", b) for b in self.sizes]
        self.budgets: dict[int, BudgetController] | None = None  # per batch bucket (`measure_step_times`)
        self.prefill_chunk = prefill_chunk
        self.model = runner.model
        self.tap_layers = tuple(drafter.config.target_layer_ids)
        self.max_depth = drafter.config.block_size - 1
        slots, device = runner.slots, runner.device
        self._length = torch.zeros(slots, dtype=torch.long, device=device)
        self._root = torch.zeros(slots, dtype=torch.long, device=device)
        self._h_last = torch.zeros(slots, self.model.config.hidden_size, dtype=self.model.embed_tokens.dtype,
                                   device=device)
        self._uniforms = torch.zeros(slots, max(p.num_nodes for p in self.proposers.values()), device=device)
        self._decoding = torch.zeros(slots, dtype=torch.bool, device=device)  # rows whose trees are committed
        self._decoding_host: list[bool] = [False] * slots
        self.graphs = PhaseGraphs(runner.graphs.enabled,
                                  per_phase=8 * (slots.bit_length() + 1) * len(self.sizes))
        # What one phase hands the next (see the module docstring), per batch bucket or per (bucket, size)
        self._drafted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # each row's E(b) of its latest draft, one buffer for every draft graph: [slots, len(sizes)]
        self._estimates = torch.zeros(slots, len(self.sizes), device=device)
        self._trees: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, TreeSpec]] = {}
        self._verified: dict[tuple[int, int], tuple] = {}
        self._produced: dict[tuple[int, int], torch.Tensor] = {}

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        for budget in (self.budgets or {}).values():  # a new request probes at the shortest interval again
            budget.start_request()

    def _release(self, seq: Sequence) -> None:
        super()._release(seq)
        self._length[seq.slot] = 0  # its throwaway trees stay at the start of the row

    # ---- the step --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, StreamDelta]]:
        """Prefill one newcomer (if any), then one speculative step of every decoding row -> each produced token
        as (request, delta); a request's last delta has its finish reason."""
        out: list[tuple[Sequence, StreamDelta]] = []
        if self._to_prefill:
            seq = self._to_prefill[0]
            delta = self._prefill_chunk(seq)
            if delta is not None:
                self._to_prefill.popleft()
                out.append((seq, delta))
                if seq.finished:
                    self._release(seq)
        rows = {s.slot: s for s in self._slots if s is not None and s not in self._to_prefill}
        if not rows:
            return out
        decoding = [slot in rows for slot in range(self.runner.slots)]
        if decoding != self._decoding_host:  # the graphs read the device copy
            self._decoding.copy_(torch.tensor(decoding))
            self._decoding_host = decoding
        bucket = batch_bucket(max(rows) + 1, self.runner.slots)
        with skinny_projections():  # a bucket's row counts are fixed: projections may take their tuned kernels
            emitted, size = self._speculate(bucket, rows)
        for slot, seq in rows.items():
            tokens = emitted[slot]
            seq.stats.count_step(size, len(tokens))
            for token in tokens:
                out.append((seq, seq.push(token)))
                if seq.finished:
                    self._release(seq)
                    break
        return out

    def _prefill_chunk(self, seq: Sequence) -> StreamDelta | None:
        """The next chunk of `seq`'s prompt into its rows (target and drafter context); once the prompt is all in,
        its first token (else None)."""
        start = time.perf_counter()
        slot, prompt = seq.slot, seq.prompt_ids
        begin = seq.length
        end = min(len(prompt), begin + self.prefill_chunk)
        last = prefill_in_chunks(
            self.model, torch.tensor(prompt[begin:end], dtype=torch.long, device=self.runner.device),
            self.runner.cache.row(slot), begin, self.prefill_chunk, self.tap_layers,
            lambda taps, first: self.drafter.append_context(torch.cat(taps, dim=-1), first, first_row=slot))
        seq.length = end
        self._length[slot] = end  # a throwaway tree of this row writes past the prompt fed so far
        seq.stats.prefill_seconds += time.perf_counter() - start
        if end < len(prompt):
            return None
        token = sample(self.model.logits(last).view(1, -1), seq.params, seq.generator).view(1)
        self._root[slot] = token[0]
        self._h_last[slot] = last
        seq.stats.verify_steps = 1  # the prefill forward produced the first token
        seq.decode_started = time.perf_counter()
        return seq.push(int(token[0]))

    def _speculate(self, bucket: int, rows: dict[int, Sequence],
                   forced_size: int | None = None) -> tuple[dict[int, list[int]], int]:
        """Draft -> trees -> one verify -> per-row acceptance -> one commit over rows 0 .. bucket - 1 -> the tokens
        each row of `rows` produced (its accepted drafts, then the bonus token) and the size the step took."""
        start = time.perf_counter()
        # every row of the bucket drafts, a row still in its prompt (not in `rows`) too: the keys cover them all
        longest = max((seq.length for seq in self._slots[:bucket] if seq is not None), default=0)
        draft_len = key_length_bucket(longest + self.max_depth, self.runner.max_len)
        budget = self.budgets[bucket] if self.budgets is not None and forced_size is None else None
        drafting = forced_size != 0 and (budget is None or budget.wants_draft())
        if drafting:
            self.graphs.run(("draft", bucket, draft_len), lambda: self._draft(bucket, draft_len))
        size, predicted = forced_size if forced_size is not None else self.sizes[-1], 0.0
        if budget is not None:
            estimate = self._mean_estimate(rows) if drafting else None
            size = budget.choose(estimate)
            predicted = estimate[self.sizes.index(size)] if estimate is not None else 0.0
        params = [rows[r].params if r in rows else None for r in range(bucket)]
        for r, seq in rows.items():
            if not seq.params.greedy:
                self._uniforms[r].uniform_(generator=seq.generator)
        sampling = tuple("greedy" if p is None or p.greedy else (p.temperature, p.top_k, p.top_p) for p in params)
        self.graphs.run(("tree", bucket, size), lambda: self._tree(bucket, size))
        self.graphs.run(("verify", bucket, size), lambda: self._verify(bucket, size))
        self.graphs.run(("commit", bucket, size, sampling), lambda: self._commit(bucket, size, params),
                        advances_state=True)
        produced_host = self._produced[(bucket, size)].tolist()  # the one host read of the step
        emitted = {}
        for slot, seq in rows.items():
            row = produced_host[slot]
            emitted[slot] = row[: row.index(-1)] if -1 in row else row
            seq.length += len(emitted[slot])
        if budget is not None and rows:
            accepted = sum(len(tokens) - 1 for tokens in emitted.values()) / len(rows)
            budget.observe(size, predicted, accepted)
            if tp_size() == 1:  # tensor-parallel ranks keep rank 0's start-up times: their choices must agree
                # T(b) counts a draft for b > 0 and none for a decode step: a drafted decode step pays one more
                extra = budget.draft_seconds if drafting and not size else 0.0
                budget.observe_seconds(size, time.perf_counter() - start - extra)
        return emitted, size

    def _mean_estimate(self, rows: dict[int, Sequence]) -> list[float]:
        """The requests' mean E(b) of every size from their drafts (one host read)."""
        per_row = self._estimates[sorted(rows)]
        return per_row.mean(dim=0).tolist()

    @torch.inference_mode()
    def measure_step_times(self, warmup: int = 1, steps: int = 3) -> dict[int, dict[int, float]]:
        """Seconds per step at every candidate size for every batch bucket (graphs captured and warmed first), on
        the rows as they are (no request may be running: the steps write throwaway trees at position 0); from
        then on each bucket's adaptive budget decides with its bucket's times. -> {bucket: {size: seconds}}."""
        if self.running:
            raise RuntimeError("step times are measured before any request joins the batch")
        if len(self.sizes) < 2:
            raise ValueError("a fixed proposal size has nothing to choose between")
        device = self.runner.device
        draft_len = key_length_bucket(self.max_depth, self.runner.max_len)
        times: dict[int, dict[int, float]] = {}
        drafts: dict[int, float] = {}
        buckets = sorted({batch_bucket(n, self.runner.slots) for n in range(1, self.runner.slots + 1)})
        with skinny_projections():
            for bucket in buckets:
                times[bucket] = {size: fastest_seconds(lambda: self._speculate(bucket, {}, forced_size=size),
                                                       warmup, steps, device) for size in self.sizes}
                drafts[bucket] = fastest_seconds(  # its graph is captured: the measuring steps drafted
                    lambda: self.graphs.run(("draft", bucket, draft_len), lambda: self._draft(bucket, draft_len)),
                    0, 1, device)
        # Tensor-parallel ranks decide with rank 0's times, so they choose the same sizes and their collectives meet.
        times, drafts = broadcast_object((times, drafts))
        self.budgets = {b: BudgetController(self.sizes, times[b], draft_seconds=drafts[b]) for b in buckets}
        return times

    # ---- phases: per-bucket device buffers in, per-bucket device buffers out ----------------------------
    def _draft(self, bucket: int, draft_len: int) -> None:
        logits, hidden = self.drafter.draft(self._root[:bucket], self._length[:bucket], draft_len)
        if bucket not in self._drafted:
            self._drafted[bucket] = (torch.empty_like(logits), torch.empty_like(hidden))
        self._drafted[bucket][0].copy_(logits)
        self._drafted[bucket][1].copy_(hidden)
        if len(self.sizes) > 1:  # copied into the batch's buffer: every draft graph of the bucket writes there
            self._estimates[:bucket].copy_(expected_accepted_by_size(logits, self._estimate_sizes))

    def _tree(self, bucket: int, size: int) -> None:
        if size == 0:  # a plain decode step: every row's tree is its root
            tokens = self._root[:bucket, None].clone()
            parents = torch.full_like(tokens, -1)
            depths = torch.zeros_like(tokens)
        else:
            logits, hidden = self._drafted[bucket]
            proposer = self.proposers[size]
            if proposer.batched:  # every row's tree in the launches of one
                tokens, parents, depths = proposer.build(self._root[:bucket], logits, hidden, self._h_last[:bucket])
            else:
                built = [proposer.build(self._root[r : r + 1], logits[r], hidden[r], self._h_last[r])
                         for r in range(bucket)]
                tokens, parents, depths = (torch.stack(parts) for parts in zip(*built))
        tree = TreeSpec.build(tokens, parents, cache_len=self._length[:bucket])
        self._trees[(bucket, size)] = (tokens, parents, depths, tree)

    def _verify(self, bucket: int, size: int) -> None:
        tree = self._trees[(bucket, size)][3]
        out, taps, saved = self.model.verify(tree, self.runner.cache.rows(0, bucket), self._length[:bucket],
                                             self.tap_layers)
        self._verified[(bucket, size)] = (out, taps, saved, self.model.logits(out))

    def _commit(self, bucket: int, size: int, params: list[SamplingParams | None]) -> None:
        """Accept every row along its target draws (argmax for greedy rows and rows without a request), commit
        the paths to the target and drafter caches, advance length / root / h_last, and write each row's
        produced tokens (-1 padded)."""
        tokens, parents, depths, tree = self._trees[(bucket, size)]
        out, taps, saved, target_logits = self._verified[(bucket, size)]
        lengths = self._length[:bucket]
        draws = target_logits.argmax(-1)
        for r, p in enumerate(params):
            if p is not None and not p.greedy:
                draws[r] = target_draws(target_logits[r], p, self._uniforms[r])
        acc = accept_tree(tokens, parents, depths, tree.ancestor_mask(), draws, self.max_depth)
        acc = acc.only(self._decoding[:bucket])
        self.model.commit(self.runner.cache.rows(0, bucket), lengths, tree, saved, acc.accepted, acc.path)
        feats = torch.cat(taps, dim=-1)
        on_path = acc.path_or_last()[:, :, None].expand(-1, -1, feats.shape[-1])
        self.drafter.append_context(feats.gather(1, on_path), lengths)
        produced = acc.emitted(tokens)
        if (bucket, size) not in self._produced:
            self._produced[(bucket, size)] = torch.empty_like(produced)
        self._produced[(bucket, size)].copy_(produced)
        self._h_last[:bucket] = out[torch.arange(bucket, device=out.device), acc.last]
        self._root[:bucket] = acc.bonus
        self._length[:bucket] += (acc.path >= 0).sum(-1)
