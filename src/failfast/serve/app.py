"""The FastAPI app of `failfast serve`: OpenAI's completions, chat, models; health, metrics.

Handlers parse and check a request (`protocol.py`), hand it to the scheduler thread and
await its events through an asyncio queue. A client that goes away cancels its job, which
frees its batch row at the next round. Every error reaches the client as OpenAI's error JSON
with a 4xx/5xx status; tracebacks go to the server log only.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from failfast.decode.engine import GenerationRequest
from failfast.errors import FailfastError
from failfast.pipeline import Pipeline
from failfast.serve import protocol
from failfast.serve.chat import ChatTemplate
from failfast.serve.metrics import ServerMetrics
from failfast.serve.protocol import BadRequest, Limits, ParsedRequest, ResponseIds
from failfast.serve.scheduler import Job, QueueFull, Scheduler, Unavailable

log = logging.getLogger("failfast.serve")
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_batch: int = 8
    max_queue: int = 64
    max_tokens: int | None = None   # per request; default: the target's context
    max_body_bytes: int = 1 << 20


class _Events:
    """Scheduler-thread callbacks -> an asyncio queue on the server's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def push(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))


def create_app(pipe: Pipeline, settings: ServerSettings) -> FastAPI:
    target = pipe.target
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise FailfastError(f"{target.path} has no tokenizer.json: the server needs one for text")
    context = target.config.max_position_embeddings
    limits = Limits(context, min(settings.max_tokens or context, context))
    metrics = ServerMetrics()
    scheduler = Scheduler(pipe.engine, settings.max_batch, settings.max_queue, context, limits.max_tokens,
                          on_round=metrics.batch)
    chat_template = ChatTemplate.for_model(target.path)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)  # the last round finishes off the event loop

    app = FastAPI(title="failfast", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.metrics = metrics

    app.add_middleware(_CountRequests, metrics=metrics)

    @app.exception_handler(BadRequest)
    async def refused(request: Request, exc: BadRequest) -> Response:
        retry = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=retry)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(protocol.error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> Response:  # a bug: logged, never shown
        log.error("request %s failed", request.url.path, exc_info=exc)
        # Starlette sends this response outside the counting middleware, so count it here
        path = request.url.path
        metrics.requests.labels(path if path in KNOWN_PATHS else "other", "500").inc()
        return JSONResponse(protocol.error_body("internal server error", "internal_error"), status_code=500)

    async def authorized(request: Request) -> None:
        if settings.api_key is not None:
            _check_key(request.headers.get("authorization", ""), settings.api_key)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise BadRequest(f"the request body exceeds {settings.max_body_bytes} bytes", status=413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > settings.max_body_bytes:
                raise BadRequest(f"the request body exceeds {settings.max_body_bytes} bytes", status=413)
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise BadRequest(f"the request body is not valid JSON ({type(exc).__name__}: {exc})") from None

    def check_model(body: Any) -> None:
        name = body.get("model") if isinstance(body, dict) else None
        if name is not None and name != settings.model_name:
            raise BadRequest(f"the model {name!r} does not exist; this server serves {settings.model_name!r}",
                             "model", status=404, code="model_not_found")

    async def run(request: Request, parsed: ParsedRequest, chat: bool) -> Response:
        events = _Events(asyncio.get_running_loop())
        job = Job(GenerationRequest(parsed.prompt_ids, parsed.max_tokens, parsed.sampling, parsed.stop),
                  on_text=(lambda text: events.push("text", text)) if parsed.stream else None,
                  on_done=lambda result: events.push("done", result),
                  on_error=lambda exc: events.push("error", exc))
        try:
            scheduler.submit(job)
        except QueueFull as exc:
            raise BadRequest(str(exc), status=429, kind="rate_limit_error", code="queue_full") from None
        except Unavailable as exc:
            raise BadRequest(str(exc), status=503, kind="service_unavailable") from None
        except FailfastError as exc:
            raise BadRequest(str(exc)) from None
        ids = ResponseIds(chat, settings.model_name)
        if parsed.stream:
            return StreamingResponse(stream(job, events, ids, parsed), media_type="text/event-stream")
        return await complete(request, job, events, ids, parsed)

    def finished(job: Job, parsed: ParsedRequest, result) -> None:
        metrics.finished(len(parsed.prompt_ids), result, time.perf_counter() - job.submitted, job.first_text_s)

    async def complete(request: Request, job: Job, events: _Events, ids: ResponseIds, parsed: ParsedRequest) -> Response:
        while True:
            try:
                kind, value = await asyncio.wait_for(events.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    scheduler.cancel(job)
                    return Response(status_code=499)  # nobody reads it; frees the row
                continue
            if kind == "done":
                finished(job, parsed, value)
                return JSONResponse(protocol.full_response(ids, len(parsed.prompt_ids), value))
            if kind == "error":
                return JSONResponse(protocol.error_body("generation failed inside the server", "internal_error"),
                                    status_code=500)

    async def stream(job: Job, events: _Events, ids: ResponseIds, parsed: ParsedRequest) -> AsyncIterator[str]:
        done = False
        try:
            if ids.chat:  # the role comes first, as OpenAI sends it
                yield _sse(protocol.text_chunk(ids, "", first=True))
            while True:
                kind, value = await events.queue.get()
                if kind == "text":
                    yield _sse(protocol.text_chunk(ids, value))
                elif kind == "done":
                    done = True
                    finished(job, parsed, value)
                    yield _sse(protocol.final_chunk(ids, value))
                    if parsed.include_usage:
                        yield _sse(protocol.usage_chunk(ids, len(parsed.prompt_ids), value))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    done = True
                    yield _sse(protocol.error_body("generation failed inside the server", "internal_error"))
                    return
        finally:
            if not done:  # the client went away: free its row
                scheduler.cancel(job)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request)
        check_model(body)
        parsed = protocol.parse_completion(body, tokenizer.encode, target.config.vocab_size, limits)
        return await run(request, parsed, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request)
        check_model(body)
        try:
            parsed = protocol.parse_chat(body, chat_template.render, tokenizer.encode, limits)
        except FailfastError as exc:
            if isinstance(exc, BadRequest):
                raise
            raise BadRequest(str(exc), "messages") from None
        return await run(request, parsed, chat=True)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "failfast", "max_model_len": context}]}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not scheduler.healthy:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        metrics.queue_depth.set(scheduler.waiting)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


KNOWN_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


class _CountRequests:
    """ASGI middleware: one count per answered HTTP request, by endpoint and status code."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted_send)


def _check_key(header: str, key: str) -> None:
    given = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise BadRequest("invalid or missing API key (send Authorization: Bearer KEY)", status=401,
                         code="invalid_api_key")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
