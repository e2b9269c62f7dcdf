"""The HTTP server: OpenAI chat/completions, native `/generate`, health, model info, cache flush, metrics.

Before a route runs, `RequestGuard` has checked the Host header, the API key, the content type and the body's
size and arrival. Handlers then validate everything they can before admission (queue room first, JSON shape,
model name, sampling values, prompt length against the context) so a bad request costs no queue slot and gets a
4xx `{"error": {message, type, code, param}}`; prompts are tokenized off the event loop (`PromptEncoder`).
Admitted requests go through the `Scheduler`; a task per request watches for the client's disconnect and
cancels its job, so an abandoned request frees its slot whether it is waiting, decoding, or streaming.
A 500 names the request id under which the traceback was logged, never the exception text.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from dflash_tfm import __version__
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.server import protocol as P
from dflash_tfm.server.args import ServerArgs
from dflash_tfm.server.errors import CLIENT_CLOSED, APIError, error_body, error_response, internal_error_message
from dflash_tfm.server.guard import GuardSettings, RequestGuard
from dflash_tfm.server.metrics import CONTENT_TYPE, RequestCounterMiddleware, ServerMetrics
from dflash_tfm.server.prompts import PromptEncoder
from dflash_tfm.server.scheduler import Job, JobCancelled, QueueFullError, Scheduler

if TYPE_CHECKING:
    from dflash_tfm.engine.engine import Engine, StreamDelta

logger = logging.getLogger("dflash_tfm.server")

ModelT = TypeVar("ModelT", bound=BaseModel)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
NO_PREFIX_CACHE = "nothing to flush: the engine keeps no prefix cache (every request is prefilled in full)"
JSON_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    """Strictly parse the JSON body (read and bounded by `RequestGuard`); every problem becomes a 400 naming
    the field."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "request body is empty; send a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise APIError(400, *P.describe_validation_error(e)) from e


def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


@dataclass
class Output:
    """What a request has produced so far."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    deltas: int = 0
    last: StreamDelta | None = None

    def add(self, delta: StreamDelta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.deltas += 1
        self.last = delta

    @property
    def finish_reason(self) -> str:
        assert self.last is not None and self.last.finish_reason is not None
        return self.last.finish_reason


class SSEResponse(StreamingResponse):
    """An event stream that runs `on_close` however the connection ends (done, client gone, error), so the
    job never outlives its client even if the body generator is left suspended."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Handlers:
    """Route handlers bound to one engine (through its scheduler) and the launch settings."""

    def __init__(self, engine: Engine, scheduler: Scheduler, args: ServerArgs, metrics: ServerMetrics) -> None:
        self.engine, self.scheduler, self.metrics = engine, scheduler, metrics
        self.prompts = PromptEncoder(engine)
        path_name = Path(engine.model_path).name
        self.model_name = args.served_model_name or path_name
        self.model_names = {self.model_name, path_name}  # what a request's "model" may say

    # ---- shared steps --------------------------------------------------------------------------------
    def completion_budget(self, n_prompt: int, requested: int | None, default: int | None, name: str,
                          prompt_field: str) -> int:
        """max_new_tokens for a prompt: an explicit request must fit the context (else 400 with the numbers);
        a default is clamped to the room left."""
        ctx = self.engine.max_model_len
        if n_prompt == 0:
            raise APIError(400, "prompt is empty", prompt_field)
        if n_prompt >= ctx:
            raise APIError(400, f"prompt has {n_prompt} tokens but the context is {ctx} tokens (max_model_len), "
                                "leaving no room for a completion; shorten the prompt", prompt_field)
        if requested is None:
            return ctx - n_prompt if default is None else min(default, ctx - n_prompt)
        if requested < 1:
            raise APIError(400, f"{name} must be >= 1, got {requested}", name)
        if n_prompt + requested > ctx:
            raise APIError(400, f"this model's context is {ctx} tokens, but {n_prompt + requested} were requested "
                                f"({n_prompt} in the prompt + {requested} {name}); reduce the prompt or {name}", name)
        return requested

    @staticmethod
    def checked(make: Callable[[], SamplingParams]) -> SamplingParams:
        """Build SamplingParams; its ValueError names the field, which becomes the error's param."""
        try:
            return make()
        except ValueError as e:
            raise APIError(400, str(e), str(e).split(" ", 1)[0].rstrip(":")) from e

    def check_room(self) -> None:
        """503 before any work for the request when the queue is full."""
        try:
            self.scheduler.check_room()
        except QueueFullError as e:
            raise APIError(503, str(e)) from e

    def check_openai(self, req: P.OpenAIRequest) -> None:
        """Refuse what OpenAI clients may ask for but this server cannot do, rather than silently ignore it,
        and a model this server does not serve (OpenAI's 404 `model_not_found`)."""
        if req.model is not None and req.model not in self.model_names:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        if req.n not in (None, 1):
            raise APIError(400, f"n must be 1 (this server returns one choice per request), got {req.n}", "n")
        unsupported = req.unsupported()
        if unsupported:
            raise APIError(400, f"not supported by this server: {', '.join(unsupported)}", unsupported[0])

    def admit(self, request: Request, prompt_ids: list[int], params: SamplingParams,
              arrived: float) -> tuple[Job, asyncio.Task]:
        """Queue the job and start watching for the client's disconnect; 503 when the queue is full."""
        try:
            job = self.scheduler.submit(prompt_ids, params, arrived)
        except QueueFullError as e:
            raise APIError(503, str(e)) from e
        return job, asyncio.create_task(self.cancel_on_disconnect(request, job))

    async def cancel_on_disconnect(self, request: Request, job: Job) -> None:
        """The body is already read, so the next ASGI message is the disconnect."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.scheduler.cancel(job)

    def release(self, job: Job, watcher: asyncio.Task) -> None:
        """Free the job's slot (no-op when it finished) and stop watching its connection."""
        self.scheduler.cancel(job)
        watcher.cancel()

    async def next_delta(self, job: Job) -> StreamDelta:
        """The job's next delta; the engine's ValueError (a request it refuses) becomes a 400."""
        try:
            return await job.next()
        except ValueError as e:
            raise APIError(400, str(e)) from e

    async def collect(self, job: Job, watcher: asyncio.Task) -> Output:
        out = Output()
        try:
            while out.last is None or out.last.finish_reason is None:
                out.add(await self.next_delta(job))
        finally:
            self.release(job, watcher)
        return out

    async def stream(self, job: Job, watcher: asyncio.Task, request_id: str,
                     events: Callable[[StreamDelta, Output], list[BaseModel]]) -> Response:
        """SSE of `events(delta, output)` per delta, then `data: [DONE]`. The first delta is awaited before the
        response starts, so errors found at prefill still get a proper HTTP status."""
        try:
            first = await self.next_delta(job)
        except BaseException:
            self.release(job, watcher)
            raise

        async def body() -> AsyncIterator[str]:
            out, delta = Output(), first
            try:
                while True:
                    out.add(delta)
                    for event in events(delta, out):
                        yield sse(event)
                    if delta.finish_reason is not None:
                        break
                    delta = await self.next_delta(job)
                yield "data: [DONE]\n\n"
            except JobCancelled:
                return
            except APIError as e:  # the response has started: report in-band, then end the stream
                yield sse(error_body(e.status, e.message, e.param, e.code))
                yield "data: [DONE]\n\n"
            except Exception:
                logger.exception("request %s: stream failed", request_id)
                yield sse(error_body(500, internal_error_message(request_id)))
                yield "data: [DONE]\n\n"
            finally:
                self.release(job, watcher)

        return SSEResponse(body(), on_close=lambda: self.release(job, watcher))

    # ---- OpenAI --------------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        self.check_room()
        req = await parse_body(request, P.ChatCompletionRequest)
        self.check_openai(req)
        if not req.messages:
            raise APIError(400, "messages must not be empty", "messages")
        kwargs = dict(req.chat_template_kwargs or {})
        thinking = kwargs.pop("enable_thinking", None)
        if kwargs or not isinstance(thinking, (bool, type(None))):
            raise APIError(400, "chat_template_kwargs supports only enable_thinking (a boolean)", "chat_template_kwargs")
        prompt_ids = await self.prompts.chat(message_dicts(req.messages), thinking)
        name = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        budget = self.completion_budget(len(prompt_ids), req.requested_max_tokens, None, name, "messages")
        params = self.checked(lambda: req.sampling_params(budget))
        job, watcher = self.admit(request, prompt_ids, params, arrived)
        rid, created, n_prompt = P.new_id("chatcmpl"), int(time.time()), len(prompt_ids)

        def chunk(delta: P.ChatDelta, finish: str | None = None) -> P.ChatCompletionChunk:
            return P.ChatCompletionChunk(id=rid, created=created, model=self.model_name,
                                         choices=[P.ChatChunkChoice(delta=delta, finish_reason=finish)])

        def events(delta: StreamDelta, out: Output) -> list[BaseModel]:
            evs: list[BaseModel] = [chunk(P.ChatDelta(role="assistant", content=""))] if out.deltas == 1 else []
            if delta.text:
                evs.append(chunk(P.ChatDelta(content=delta.text)))
            if delta.finish_reason is not None:
                evs.append(chunk(P.ChatDelta(), delta.finish_reason))
                if req.include_usage:
                    evs.append(P.ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[],
                                                     usage=P.Usage.of(n_prompt, len(out.token_ids))))
            return evs

        if req.stream:
            return await self.stream(job, watcher, request.state.request_id, events)
        out = await self.collect(job, watcher)
        resp = P.ChatCompletionResponse(
            id=rid, created=created, model=self.model_name, usage=P.Usage.of(n_prompt, len(out.token_ids)),
            choices=[P.ChatChoice(message=P.AssistantMessage(content=out.text), finish_reason=out.finish_reason)],
        )
        return JSONResponse(resp.model_dump())

    async def completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        self.check_room()
        req = await parse_body(request, P.CompletionRequest)
        self.check_openai(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"one prompt per request is supported, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        prompt_ids = await self.prompts.text(prompt, "prompt") if isinstance(prompt, str) else self.prompts.ids(prompt, "prompt")
        budget = self.completion_budget(len(prompt_ids), req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS,
                                        "max_tokens", "prompt")
        params = self.checked(lambda: req.sampling_params(budget))
        job, watcher = self.admit(request, prompt_ids, params, arrived)
        rid, created, n_prompt = P.new_id("cmpl"), int(time.time()), len(prompt_ids)

        def events(delta: StreamDelta, out: Output) -> list[BaseModel]:
            evs: list[BaseModel] = []
            if delta.text or delta.finish_reason is not None:
                choice = P.CompletionChoice(text=delta.text, finish_reason=delta.finish_reason)
                evs.append(P.CompletionResponse(id=rid, created=created, model=self.model_name, choices=[choice]))
            if delta.finish_reason is not None and req.include_usage:
                evs.append(P.CompletionResponse(id=rid, created=created, model=self.model_name, choices=[],
                                                usage=P.Usage.of(n_prompt, len(out.token_ids))))
            return evs

        if req.stream:
            return await self.stream(job, watcher, request.state.request_id, events)
        out = await self.collect(job, watcher)
        resp = P.CompletionResponse(
            id=rid, created=created, model=self.model_name, usage=P.Usage.of(n_prompt, len(out.token_ids)),
            choices=[P.CompletionChoice(text=out.text, finish_reason=out.finish_reason)],
        )
        return JSONResponse(resp.model_dump())

    async def models(self) -> Response:
        card = P.ModelCard(id=self.model_name, root=self.model_name, max_model_len=self.engine.max_model_len)
        return JSONResponse(P.ModelList(data=[card]).model_dump())

    # ---- native --------------------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        """SGLang's /generate. finish_reason is SGLang's object ({"type": "stop"|"length"}); streamed chunks carry
        the cumulative text and output_ids, as SGLang's do."""
        arrived = time.perf_counter()
        self.check_room()
        req = await parse_body(request, P.GenerateRequest)
        if (req.text is None) == (req.input_ids is None):
            raise APIError(400, "give exactly one of text or input_ids", "text")
        if req.text is not None:
            prompt_field, prompt_ids = "text", await self.prompts.text(req.text, "text")
        else:
            prompt_field, prompt_ids = "input_ids", self.prompts.ids(req.input_ids or [], "input_ids")
        sp = req.sampling_params
        budget = self.completion_budget(len(prompt_ids), sp.max_new_tokens, GENERATE_DEFAULT_MAX_NEW_TOKENS,
                                        "sampling_params.max_new_tokens", prompt_field)
        params = self.checked(lambda: sp.to_sampling_params(budget))
        job, watcher = self.admit(request, prompt_ids, params, arrived)
        rid = req.rid or P.new_id("gen")

        def result(delta: StreamDelta, out: Output) -> P.GenerateResponse:
            finish = None
            if delta.finish_reason is not None:
                finish = P.NativeFinishReason(type=delta.finish_reason,
                                              length=len(out.token_ids) if delta.finish_reason == "length" else None)
            meta = P.MetaInfo(id=rid, prompt_tokens=len(prompt_ids), completion_tokens=len(out.token_ids),
                              spec_verify_ct=delta.stats.verify_steps, finish_reason=finish,
                              e2e_latency=time.perf_counter() - arrived)
            return P.GenerateResponse(text=out.text, output_ids=list(out.token_ids), meta_info=meta)

        if req.stream:
            return await self.stream(job, watcher, request.state.request_id, lambda delta, out: [result(delta, out)])
        out = await self.collect(job, watcher)
        assert out.last is not None
        return JSONResponse(result(out.last, out).model_dump())

    async def health(self) -> Response:
        if not self.scheduler.alive:
            return error_response(503, "engine worker is not running")
        return JSONResponse({"status": "ok"})

    async def health_generate(self, request: Request) -> Response:
        """Healthy only if a 1-token generation goes through the queue and the engine."""
        params = SamplingParams(max_new_tokens=1)
        job, watcher = self.admit(request, await self.prompts.text("ping", "text"), params, time.perf_counter())
        await self.collect(job, watcher)
        return JSONResponse({"status": "ok"})

    async def flush_cache(self) -> Response:
        return JSONResponse({"success": True, "message": NO_PREFIX_CACHE})

    async def get_model_info(self) -> Response:
        """SGLang's fields, with file names where SGLang shows paths (no absolute path leaves the server), and
        the speculative settings as the engine runs them (the drafter's own block size, the tree budget)."""
        name = Path(self.engine.model_path).name
        return JSONResponse({
            "model_path": name,
            "tokenizer_path": name,
            "served_model_name": self.model_name,
            "is_generation": True,
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.config.vocab_size,
            "max_admitted_requests": self.scheduler.max_admitted,
            "max_running_requests": self.engine.max_running_requests,
            **self.engine.speculative.describe(),
            "speculative_step_ms_by_size": getattr(self.engine, "budget_step_ms", None),
        })

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def message_dicts(messages: list[P.ChatMessage]) -> list[dict]:
    """Chat messages as the chat template wants them; text parts are joined, other parts refused."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text" or p.text is None]
            if bad:
                raise APIError(400, f"messages.{i}.content: only text parts are supported, got {bad[0]!r}",
                               f"messages.{i}.content")
            content = "\n".join(p.text or "" for p in content)
        out.append({"role": m.role, "content": content or ""} | ({"name": m.name} if m.name is not None else {}))
    return out


def create_app(engine: Engine, server_args: ServerArgs | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; the engine worker thread lives as long as the app's lifespan."""
    args = server_args or ServerArgs()
    metrics = ServerMetrics(engine.speculative.algorithm)
    scheduler = Scheduler(engine, args.max_admitted_requests, metrics)
    metrics.max_running.set(engine.max_running_requests)
    h = Handlers(engine, scheduler, args, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            scheduler.shutdown()
            h.prompts.close()

    app = FastAPI(title="dflash-tfm", version=__version__, lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    # Middleware added last runs first: the counter sees every response, the guard's refusals included.
    app.add_middleware(RequestGuard, settings=GuardSettings(
        api_key=args.api_key, allowed_hosts=args.allowed_hosts, max_request_bytes=args.max_request_bytes,
        read_timeout=args.timeout_read, json_routes=JSON_ROUTES))
    routes = (
        ("/v1/chat/completions", h.chat_completions, ["POST"]),
        ("/v1/completions", h.completions, ["POST"]),
        ("/v1/models", h.models, ["GET"]),
        ("/generate", h.generate, ["POST"]),
        ("/health", h.health, ["GET"]),
        ("/health_generate", h.health_generate, ["GET"]),
        ("/flush_cache", h.flush_cache, ["GET", "POST"]),
        ("/get_model_info", h.get_model_info, ["GET"]),
        ("/metrics", h.prometheus, ["GET"]),
    )
    app.add_middleware(RequestCounterMiddleware, metrics=metrics, routes=frozenset(path for path, _, _ in routes))
    for path, endpoint, methods in routes:
        for method in methods:  # one route per method: each gets its own OpenAPI operation id
            app.add_api_route(path, endpoint, methods=[method], operation_id=f"{endpoint.__name__}_{method.lower()}")

    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(exc.status_code, str(exc.detail))

    async def on_client_gone(_: Request, exc: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(JobCancelled, on_client_gone)
    return app
