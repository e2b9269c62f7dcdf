"""Continuous batching of speculative decoding: many requests, one drafter pass and one target verify per step.

Why: while the target is weight-bound, verifying the trees of several sequences in one forward costs little more
than verifying one, so a server with speculative decoding should not make its clients take turns. Each running
request owns one row (slot) of the target's cache (`BatchRunner`) and of the drafter's context cache
(`DFlashDrafter.allocate(..., batch=slots)`). A `step`:

1. prefills the prompt of at most one newcomer, whole (in chunks of `prefill_chunk`), into its rows, and draws
   its first token: the trees of the running rows share the target's forward, and a row still in its prompt
   could not sit out that forward's commit, so a newcomer joins only once its prompt is in;
2. drafts every row of the step's batch bucket in one drafter pass, each row at its own length;
3. builds one tree per row with the proposer (row by row: the builders are batch-1);
4. verifies all trees in ONE target forward (tree attention and the Gated-DeltaNet tree kernels take a batch
   with one committed length per row);
5. accepts each row along its own target draws, with its request's own sampling settings and generator (the
   uniforms are drawn from it in the same order as when the request decodes alone, so a request's tokens do not
   depend on which others share its steps), and commits every row's path in one call;
6. reads the produced tokens of every row at once (one host read) and pushes them through each request's stop
   conditions.

Rows of the bucket that hold no request run a throwaway tree at position 0: admission resets the row's state and
the prefill overwrites what that wrote. The proposal size is fixed (the engine's tree budget); the caches carry
`TREE_SLACK` positions beyond the context so a request can decode to the last position of its context with a
whole tree.

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
from dflash_tfm.engine.batch_slots import BatchSlots
from dflash_tfm.engine.model_runner import key_length_bucket, prefill_in_chunks
from dflash_tfm.engine.phase_graphs import PhaseGraphs
from dflash_tfm.engine.sequence import Sequence, StreamDelta
from dflash_tfm.engine.speculative import Proposer
from dflash_tfm.layers.linear import skinny_projections
from dflash_tfm.sampling import sample
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.accept import accept_tree, target_draws
from dflash_tfm.tree import TreeSpec

TREE_SLACK = 64  # cache positions past the context: the deepest tree a drafter block (<= 64) can propose


class SpeculativeBatch(BatchSlots):
    def __init__(self, runner: BatchRunner, drafter, proposer: Proposer, max_len: int,
                 prefill_chunk: int = 2048) -> None:
        """runner: the target's rows (`max_len` + `TREE_SLACK` positions each); drafter: its context caches with
        at least `runner.slots` rows; proposer: the tree every row builds; max_len: the context a request may
        fill (`Sequence.budget` keeps it there)."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if runner.max_len < max_len + drafter.config.block_size or drafter.batch < runner.slots:
            raise ValueError(f"the batch needs {runner.slots} drafter rows and target rows of >= "
                             f"{max_len + drafter.config.block_size} positions (max_len + a tree)")
        super().__init__(runner)
        self.drafter, self.proposer = drafter, proposer
        self.prefill_chunk = prefill_chunk
        self.model = runner.model
        self.tap_layers = tuple(drafter.config.target_layer_ids)
        self.max_depth = drafter.config.block_size - 1
        slots, device = runner.slots, runner.device
        self._length = torch.zeros(slots, dtype=torch.long, device=device)
        self._root = torch.zeros(slots, dtype=torch.long, device=device)
        self._h_last = torch.zeros(slots, self.model.config.hidden_size, dtype=self.model.embed_tokens.dtype,
                                   device=device)
        self._uniforms = torch.zeros(slots, proposer.num_nodes, device=device)
        self.graphs = PhaseGraphs(runner.graphs.enabled, per_phase=8 * (slots.bit_length() + 1))
        # Per batch bucket, what one phase hands the next (see the module docstring)
        self._drafted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._trees: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, TreeSpec]] = {}
        self._verified: dict[int, tuple] = {}
        self._produced: dict[int, torch.Tensor] = {}

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
            seq = self._to_prefill.popleft()
            delta = self._prefill(seq)
            out.append((seq, delta))
            if seq.finished:
                self._release(seq)
        rows = {s.slot: s for s in self._slots if s is not None and s not in self._to_prefill}
        if not rows:
            return out
        bucket = batch_bucket(max(rows) + 1, self.runner.slots)
        with skinny_projections():  # a bucket's row counts are fixed: projections may take their tuned kernels
            emitted = self._speculate(bucket, rows)
        for slot, seq in rows.items():
            tokens = emitted[slot]
            seq.stats.count_step(self.proposer.num_nodes - 1, len(tokens))
            for token in tokens:
                out.append((seq, seq.push(token)))
                if seq.finished:
                    self._release(seq)
                    break
        return out

    def _prefill(self, seq: Sequence) -> StreamDelta:
        """The whole prompt into `seq`'s rows (target and drafter context), then its first token."""
        start = time.perf_counter()
        slot, prompt = seq.slot, seq.prompt_ids
        last = prefill_in_chunks(
            self.model, torch.tensor(prompt, dtype=torch.long, device=self.runner.device), self.runner.cache.row(slot),
            0, self.prefill_chunk, self.tap_layers,
            lambda taps, first: self.drafter.append_context(torch.cat(taps, dim=-1), first, first_row=slot))
        token = sample(self.model.logits(last).view(1, -1), seq.params, seq.generator).view(1)
        self._root[slot] = token[0]
        self._h_last[slot] = last
        self._length[slot] = len(prompt)
        seq.length = len(prompt)
        seq.stats.prefill_seconds += time.perf_counter() - start
        seq.stats.verify_steps = 1  # the prefill forward produced the first token
        seq.decode_started = time.perf_counter()
        return seq.push(int(token[0]))

    def _speculate(self, bucket: int, rows: dict[int, Sequence]) -> dict[int, list[int]]:
        """Draft -> trees -> one verify -> per-row acceptance -> one commit over rows 0 .. bucket - 1; the tokens
        each decoding row produced (its accepted drafts, then the bonus token)."""
        longest = max(seq.length for seq in rows.values())
        draft_len = key_length_bucket(longest + self.max_depth, self.runner.max_len)
        params = [rows[r].params if r in rows else None for r in range(bucket)]
        for r, seq in rows.items():
            if not seq.params.greedy:
                self._uniforms[r].uniform_(generator=seq.generator)
        sampling = tuple("greedy" if p is None or p.greedy else (p.temperature, p.top_k, p.top_p) for p in params)
        self.graphs.run(("draft", bucket, draft_len), lambda: self._draft(bucket, draft_len))
        self.graphs.run(("tree", bucket), lambda: self._tree(bucket))
        self.graphs.run(("verify", bucket), lambda: self._verify(bucket))
        self.graphs.run(("commit", bucket, sampling), lambda: self._commit(bucket, params), advances_state=True)
        produced_host = self._produced[bucket].tolist()  # the one host read of the step
        emitted = {}
        for slot, seq in rows.items():
            row = produced_host[slot]
            emitted[slot] = row[: row.index(-1)] if -1 in row else row
            seq.length += len(emitted[slot])
        return emitted

    # ---- phases: per-bucket device buffers in, per-bucket device buffers out ----------------------------
    def _draft(self, bucket: int, draft_len: int) -> None:
        logits, hidden = self.drafter.draft(self._root[:bucket], self._length[:bucket], draft_len)
        if bucket not in self._drafted:
            self._drafted[bucket] = (torch.empty_like(logits), torch.empty_like(hidden))
        self._drafted[bucket][0].copy_(logits)
        self._drafted[bucket][1].copy_(hidden)

    def _tree(self, bucket: int) -> None:
        logits, hidden = self._drafted[bucket]
        built = [self.proposer.build(self._root[r : r + 1], logits[r], hidden[r], self._h_last[r])
                 for r in range(bucket)]
        tokens, parents, depths = (torch.stack(parts) for parts in zip(*built))
        self._trees[bucket] = (tokens, parents, depths, TreeSpec.build(tokens, parents, cache_len=self._length[:bucket]))

    def _verify(self, bucket: int) -> None:
        tree = self._trees[bucket][3]
        out, taps, saved = self.model.verify(tree, self.runner.cache.rows(0, bucket), self._length[:bucket],
                                             self.tap_layers)
        self._verified[bucket] = (out, taps, saved, self.model.logits(out))

    def _commit(self, bucket: int, params: list[SamplingParams | None]) -> None:
        """Accept every row along its target draws (argmax for greedy rows and rows without a request), commit
        the paths to the target and drafter caches, advance length / root / h_last, and write each row's
        produced tokens (-1 padded)."""
        tokens, parents, depths, tree = self._trees[bucket]
        out, taps, saved, target_logits = self._verified[bucket]
        lengths = self._length[:bucket]
        draws = target_logits.argmax(-1)
        for r, p in enumerate(params):
            if p is not None and not p.greedy:
                draws[r] = target_draws(target_logits[r], p, self._uniforms[r])
        acc = accept_tree(tokens, parents, depths, tree.ancestor_mask(), draws, self.max_depth)
        self.model.commit(self.runner.cache.rows(0, bucket), lengths, tree, saved, acc.accepted, acc.path)
        feats = torch.cat(taps, dim=-1)
        on_path = acc.path_or_last()[:, :, None].expand(-1, -1, feats.shape[-1])
        self.drafter.append_context(feats.gather(1, on_path), lengths)
        produced = acc.emitted(tokens)
        if bucket not in self._produced:
            self._produced[bucket] = torch.empty_like(produced)
        self._produced[bucket].copy_(produced)
        self._h_last[:bucket] = out[torch.arange(bucket, device=out.device), acc.last]
        self._root[:bucket] = acc.bonus
        self._length[:bucket] += (acc.path >= 0).sum(-1)
