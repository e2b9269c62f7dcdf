"""FIFO admission and the one worker thread that owns the engine.

The engine is not thread-safe, so exactly one thread ever calls it: requests are admitted into a bounded FIFO
(beyond the bound, `submit` raises `QueueFullError` and the server answers 503) and the worker feeds them to the
engine. An engine with continuous batching (`max_running_requests` > 1, autoregressive) takes waiting jobs
whenever it has a free slot and decodes all of them together, one `Engine.step` at a time; otherwise (a
speculative algorithm, batch 1) the worker runs one job's `Engine.stream` after another. Deltas travel to the
request's event loop through an asyncio.Queue filled with `loop.call_soon_threadsafe`. Cancelling a waiting job
removes it at once; cancelling a running one sets a flag the worker checks between steps (tokens), after which it
aborts the request in the engine (freeing its slot) or closes its stream.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from dflash_tfm.engine.result import GenerationStats
from dflash_tfm.engine.sequence import Sequence
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from dflash_tfm.engine.engine import Engine, StreamDelta

logger = logging.getLogger("dflash_tfm.server")


class QueueFullError(Exception):
    """Admission refused: the bound on running + waiting requests is reached."""


class JobCancelled(Exception):
    """The job was cancelled (its client left, or the server is shutting down) before it finished."""


@dataclass(eq=False)
class Job:
    """One admitted request, shared by its HTTP handler (event loop) and the engine worker (thread)."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    arrived: float  # time.perf_counter() when the HTTP request arrived
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: bool = False  # set by the worker (under the scheduler lock) before its last delivery
    _items: asyncio.Queue = field(default_factory=asyncio.Queue)

    def deliver(self, item: StreamDelta | BaseException) -> None:
        """Hand a delta or an error to the handler; thread-safe. A closed loop means nobody listens any more."""
        try:
            self.loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:
            self.cancelled.set()

    async def next(self) -> StreamDelta:
        """The next delta; raises JobCancelled, or the engine's error (ValueError for a bad request)."""
        item = await self._items.get()
        if isinstance(item, BaseException):
            raise item
        return item


class Scheduler:
    def __init__(self, engine: Engine, max_admitted: int, metrics: ServerMetrics) -> None:
        if max_admitted < 1:
            raise ValueError(f"max_admitted must be >= 1, got {max_admitted}")
        self.engine, self.max_admitted, self.metrics = engine, max_admitted, metrics
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- event-loop side -----------------------------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._worker, name="dflash-tfm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel everything admitted and stop the worker after its current token."""
        with self._cond:
            self._stopping = True
            for job in self._waiting:
                job.cancelled.set()
                job.deliver(JobCancelled("server shutting down"))
            self._waiting.clear()
            for job in self._running:
                job.cancelled.set()
            self._publish_counts()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check_room(self) -> None:
        """QueueFullError now if a request could not be admitted: handlers call it before tokenizing, so a
        server at capacity refuses without doing any work for the request. (`submit` checks again.)"""
        with self._cond:
            self._check_room()

    def _check_room(self) -> None:
        if self._stopping:
            raise QueueFullError("server is shutting down")
        admitted = len(self._waiting) + len(self._running)
        if admitted >= self.max_admitted:
            raise QueueFullError(
                f"server is at capacity: {admitted} requests admitted ({len(self._running)} decoding, the rest "
                "waiting), "
                f"limit {self.max_admitted} (--max-queued-requests, default 16 x --max-running-requests); retry later"
            )

    def submit(self, prompt_ids: list[int], params: SamplingParams, arrived: float) -> Job:
        """Admit a request at the back of the queue (call from the event loop); QueueFullError when full."""
        job = Job(prompt_ids, params, asyncio.get_running_loop(), arrived)
        with self._cond:
            self._check_room()
            self._waiting.append(job)
            self._publish_counts()
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Free the job's slot: a waiting job leaves the queue now, a running one stops before its next step.
        Idempotent; a no-op once the job has finished."""
        with self._cond:
            if job.finished or job.cancelled.is_set():
                return
            if job in self._waiting:
                self._waiting.remove(job)
                self._publish_counts()
            job.cancelled.set()
            self.metrics.aborted.inc()
        job.deliver(JobCancelled("request cancelled"))

    # ---- worker side ---------------------------------------------------------------------------------
    def _publish_counts(self) -> None:
        """Update the gauges; call with the lock held."""
        self.metrics.queued.set(len(self._waiting))
        self.metrics.running.set(len(self._running))

    def _worker(self) -> None:
        if self.engine.max_running_requests > 1:
            self._serve_batched()
        else:
            self._serve_one_at_a_time()

    def _serve_one_at_a_time(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._waiting.popleft()
                self._running.append(job)
                self._publish_counts()
            try:
                self._run(job)
            except Exception:  # a bug here must not kill the only thread that serves requests
                logger.exception("engine worker failed on a request")
                self._fail(job)
            finally:
                self._leave(job)

    def _serve_batched(self) -> None:
        """Continuous batching: between engine steps, cancelled jobs leave and waiting jobs take free slots."""
        running: dict[Sequence, tuple[Job, _Progress]] = {}  # each sequence's job and what was counted of it
        while True:
            with self._cond:
                while not self._waiting and not running and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    for seq in running:
                        self.engine.abort_request(seq)
                    return
                joining = []
                while self._waiting and self.engine.free_slots > len(joining):
                    joining.append(self._waiting.popleft())
                self._running.extend(joining)
                self._publish_counts()
            for job in joining:
                try:
                    running[self.engine.add_request(job.prompt_ids, job.params)] = job, _Progress()
                except ValueError as e:  # the engine rejected the request (prompt too long, bad ids, ...)
                    self._finish(job)
                    job.deliver(e)
                    self._leave(job)
            for seq in [seq for seq, (job, _) in running.items() if job.cancelled.is_set()]:
                self.engine.abort_request(seq)
                self._leave(running.pop(seq)[0])
            if not running:
                continue
            self.metrics.batch_size.observe(len(running))
            try:
                produced = self.engine.step()
            except Exception:  # a bug here must not kill the only thread that serves requests
                logger.exception("engine worker failed on a batch step")
                for seq, (job, _) in running.items():
                    self.engine.abort_request(seq)
                    self._fail(job)
                    self._leave(job)
                running.clear()
                continue
            for seq, delta in produced:
                job, progress = running[seq]
                if self._on_delta(job, progress, delta):
                    del running[seq]
                    self._leave(job)

    def _fail(self, job: Job) -> None:
        self._finish(job)
        job.deliver(RuntimeError("internal error in the engine worker"))

    def _leave(self, job: Job) -> None:
        """The job holds no slot any more (finished, failed, cancelled or rejected)."""
        with self._cond:
            job.finished = True
            if job in self._running:
                self._running.remove(job)
            self._publish_counts()

    def _finish(self, job: Job) -> None:
        """Mark the job finished before its last delivery, so a handler cleaning up afterwards does not count
        it as aborted."""
        with self._cond:
            job.finished = True

    def _count_speculation(self, stats: GenerationStats, counted: GenerationStats) -> None:
        m = self.metrics
        m.verify_steps.inc(stats.verify_steps - counted.verify_steps)
        m.draft_tokens.inc(stats.draft_tokens - counted.draft_tokens)
        m.accepted_tokens.inc(stats.accepted_draft_tokens - counted.accepted_draft_tokens)
        for size, steps in stats.draft_sizes.items():
            m.steps_by_size(size).inc(steps - counted.draft_sizes.get(size, 0))
        counted.verify_steps, counted.draft_tokens = stats.verify_steps, stats.draft_tokens
        counted.accepted_draft_tokens, counted.draft_sizes = stats.accepted_draft_tokens, dict(stats.draft_sizes)

    def _on_delta(self, job: Job, progress: _Progress, delta: StreamDelta) -> bool:
        """Count one delta in the metrics and hand it to the job's handler -> whether it was the job's last."""
        m = self.metrics
        now = time.perf_counter()
        if progress.first_at is None:
            progress.first_at = now
            m.prompt_tokens.inc(len(job.prompt_ids))
            m.ttft.observe(now - job.arrived)
            m.prefill.observe(delta.stats.prefill_seconds)
        m.generation_tokens.inc(len(delta.token_ids))
        stats = replace(delta.stats, draft_sizes=dict(delta.stats.draft_sizes))  # the engine reuses its own
        delta = replace(delta, stats=stats)
        self._count_speculation(delta.stats, progress.counted)
        if delta.finish_reason is None:
            job.deliver(delta)
            return False
        self._finish(job)
        job.deliver(delta)
        m.decode.observe(now - progress.first_at)
        m.e2e_latency.observe(now - job.arrived)
        m.accept_length.observe(delta.stats.accept_length)
        return True

    def _run(self, job: Job) -> None:
        """Decode one job, checking its cancel flag between tokens; closing the stream stops the engine."""
        if job.cancelled.is_set():
            return
        stream = self.engine.stream(job.prompt_ids, job.params)
        progress = _Progress()
        try:
            for delta in stream:
                if self._on_delta(job, progress, delta) or job.cancelled.is_set():
                    return
        except ValueError as e:  # the engine rejected the request (prompt too long, bad ids, ...)
            self._finish(job)
            job.deliver(e)
        finally:
            stream.close()


@dataclass
class _Progress:
    """What the metrics already hold of one running job: when its first token came, its speculation counts."""

    first_at: float | None = None
    counted: GenerationStats = field(default_factory=GenerationStats)
