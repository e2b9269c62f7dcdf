"""Prometheus metrics of one server, in its own registry (so several apps in one process never collide).

Token counters move per generated token, from the engine worker, so a cancelled request counts exactly the
tokens it really decoded. Latency histograms are observed when a request finishes normally; the batch-size
histogram once per continuous-batching step, with the requests that step decoded. Speculation
counters (verify steps, drafted and accepted tokens, decode steps per proposal size) carry the algorithm as a label
("none" when decoding is autoregressive), so acceptance can be read as accepted / drafted, tokens per step as
generated / steps, and an adaptive budget's choices from the steps per size.

The exposition is served as text format 0.0.4, which every Prometheus 2.x scraper accepts (the client library's
newest format, 1.0.0, is refused by scrapers before 3.0).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

PREFIX = "dflash_tfm"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
ACCEPT_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class ServerMetrics:
    def __init__(self, algorithm: str | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        algo = {"algorithm": algorithm or "none"}
        self.verify_steps = Counter(f"{PREFIX}_spec_verify_steps", "Target forward passes that produced tokens "
                                    "(prefill included)", ["algorithm"], registry=r).labels(**algo)
        self.draft_tokens = Counter(f"{PREFIX}_spec_draft_tokens", "Tokens proposed to the target for verification",
                                    ["algorithm"], registry=r).labels(**algo)
        self.accepted_tokens = Counter(f"{PREFIX}_spec_accepted_tokens", "Proposed tokens the target accepted",
                                       ["algorithm"], registry=r).labels(**algo)
        self._steps_by_size = Counter(f"{PREFIX}_spec_steps", "Decode steps by proposal size (drafts verified; 0: a "
                                      "plain decode step), as the budget chose them", ["algorithm", "size"], registry=r)
        self._algorithm = algo["algorithm"]
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.aborted = Counter(f"{PREFIX}_aborted_requests", "Requests cancelled before finishing (client left)",
                               registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated (counted as decoded)",
                                         registry=r)
        self.accept_length = Histogram(f"{PREFIX}_accept_length", "Tokens per target verify step (tau) per request",
                                       buckets=ACCEPT_BUCKETS, registry=r)
        self.e2e_latency = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Arrival to last token",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first token (queue wait included)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram(f"{PREFIX}_prefill_seconds", "Prompt prefill time per request",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.decode = Histogram(f"{PREFIX}_decode_seconds", "First to last token per request",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge(f"{PREFIX}_num_running_requests", "Requests being decoded (holding a batch slot)",
                             registry=r)
        self.max_running = Gauge(f"{PREFIX}_max_running_requests", "Requests the engine decodes together at most "
                                 "(--max-running-requests; 1 for speculative decoding)", registry=r)
        self.batch_size = Histogram(f"{PREFIX}_batch_size", "Requests in the running batch at each engine step "
                                    "(continuous batching)", buckets=BATCH_BUCKETS, registry=r)
        self.queued = Gauge(f"{PREFIX}_num_queued_requests", "Admitted requests waiting for the engine", registry=r)

    def steps_by_size(self, size: int):
        return self._steps_by_size.labels(algorithm=self._algorithm, size=str(size))

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class RequestCounterMiddleware:
    """Pure ASGI middleware counting every HTTP response by route and status.

    Pure ASGI (not BaseHTTPMiddleware) so that `receive` reaches the routes untouched and disconnect
    detection keeps working. Requests are counted by path when it is one of `routes` (also those refused before
    routing, e.g. 401 or 413), else as "other", to bound label cardinality.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: frozenset[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees if the app raises before starting a response

        async def send_and_record(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            endpoint = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
