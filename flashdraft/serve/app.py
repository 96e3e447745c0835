"""The FastAPI app: OpenAI routes, SSE streaming, errors as {"error": {...}}, /health and /metrics; who may talk to
it (the API key, the Host header, JSON bodies only)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from .. import __version__
from ..decoding import GenerationResult
from .protocol import (ApiError, ChatRequest, CompletionRequest, Parsed, Served, chunk_body, completion_body,
                       extension, new_id, unix_time, parse, parse_json, sse, usage)
from .scheduler import Scheduler
from .worker import Job

log = logging.getLogger("flashdraft.serve")

POLL_S = 0.25  # how often a non-streaming handler checks whether its client is still there
PARSE_THREADS = 2  # requests are parsed and tokenized off the event loop, each thread with its own tokenizer

OPEN_PATHS = ("/health",)  # answered without the API key (load balancers probe it)
LOOPBACK_NAMES = ["localhost", "127.0.0.1", "[::1]"]
BODIES: dict[str, type[BaseModel]] = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest}

ABORTS = {"timeout": (504, "timeout_error", "request_timeout"), "shutdown": (503, "unavailable_error", "shutting_down"),
          "client": (499, "cancelled", "client_closed_request")}


def outcome_of(status: int) -> str:
    return {429: "rejected", 503: "unavailable", 504: "timeout", 499: "cancelled"}.get(
        status, "error" if status >= 500 else "bad_request")


def abort_error(reason: str, timeout: float) -> ApiError:
    status, type_, code = ABORTS.get(reason, ABORTS["client"])
    message = {"timeout": f"the request did not finish within the server's request timeout ({timeout:g} s)",
               "shutdown": "the server shut down before the request finished"}.get(reason, "the request was cancelled")
    return ApiError(status, message, type_, code=code)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed limit bytes, and with 408 when it has not all
    arrived within timeout seconds (a client trickling a body would otherwise hold its connection forever)."""
    declared = request.headers.get("content-length", "")
    too_big = ApiError(413, f"the request body exceeds the server's limit of {limit} bytes", code="body_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big

    async def chunks() -> bytes:
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(chunks(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within the server's limit of {timeout:g} s",
                       code="body_timeout") from None


async def next_event(job: Job, timeout: float, request: Request | None = None) -> tuple[str, object]:
    """The worker's next event for job; ApiError at the deadline or, given its request, when the client has left."""
    while True:
        remaining = job.deadline - time.monotonic()
        if remaining <= 0:
            job.abort("timeout")
            raise abort_error("timeout", timeout)
        try:
            return await asyncio.wait_for(job.events.get(), min(remaining, POLL_S))
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                job.abort("client")
                raise abort_error("client", timeout) from None


def terminal(kind: str, payload, timeout: float) -> GenerationResult:
    """A "done" event's result; the other final events become the client's error (a failure names only the request
    id: what went wrong is in the server log, never in the response)."""
    if kind == "done":
        return payload
    if kind == "aborted":
        raise abort_error(payload, timeout)
    raise ApiError(500, f"the server failed while generating this response (request id {payload}); the server log "
                        "has the details", "server_error", code="internal_error")


class Guard:
    """Pure ASGI middleware (streams and disconnects pass untouched): the API key on every route but /health (401),
    and a JSON content type on every POST (415), so that a web page cannot send a "simple" text/plain request."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self.refusal(Headers(scope=scope), scope["method"], scope["path"])
            if error is not None:
                return await JSONResponse(error.body(), error.status, headers=error.headers)(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, headers: Headers, method: str, path: str) -> ApiError | None:
        if self.api_key and path not in OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                return ApiError(401, "a missing or wrong API key: send the header Authorization: Bearer <key>",
                                "authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if method == "POST":
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return ApiError(415, f"the request body must be JSON, sent with Content-Type: application/json "
                                     f"(got {media or 'no content type'})", code="unsupported_media_type")
        return None


def allowed_hosts(host: str, extra: list[str] | None) -> list[str]:
    """The Host header values the server answers: loopback names and the bound address, plus extra; a wildcard bind
    (0.0.0.0, ::) without extra answers any ("*"). A page on another site that rebinds its DNS name to 127.0.0.1
    still sends its own name as the Host, and is refused."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if (ip is not None and ip.is_unspecified) or host in ("", "*"):
        return list(extra) if extra else ["*"]
    bound = f"[{host}]" if ip is not None and ip.version == 6 else host
    return list(dict.fromkeys(LOOPBACK_NAMES + [bound.lower()] + list(extra or [])))


def openapi(app: FastAPI) -> dict:
    """The OpenAPI schema with the request bodies the completion routes take (they read the raw body, to bound its
    size and time before parsing, so FastAPI cannot see the models)."""
    if app.openapi_schema is None:
        schema = get_openapi(title="flashdraft", version=__version__, routes=app.routes)
        models = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            models.update(body.pop("$defs", {}))
            models[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
    return app.openapi_schema


class JobStream(StreamingResponse):
    """SSE response that frees its job's slot however it ends (Starlette cancels it when the client leaves)."""

    def __init__(self, content: AsyncIterator[bytes], job: Job, scheduler: Scheduler):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job, self.scheduler = job, scheduler

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.scheduler.finish(self.job, "cancelled")  # no-op when the stream ended normally


def create_app(scheduler: Scheduler, served: Served, api_key: str | None = None,
               hosts: list[str] | None = None) -> FastAPI:
    """The OpenAI-compatible app around one scheduler (one model); api_key: the Bearer token every route but /health
    needs (None: none); hosts: the Host header values it answers (None: any; see allowed_hosts)."""
    started = unix_time()
    pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="flashdraft-parse")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await scheduler.start()
        yield
        await scheduler.stop()
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="flashdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: openapi(app)
    app.add_middleware(Guard, api_key=api_key)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts or ["*"], www_redirect=False)  # the outermost
    add_error_handlers(app, scheduler)
    add_info_routes(app, scheduler, served, started)
    add_completion_routes(app, scheduler, served, pool)
    return app


def add_error_handlers(app: FastAPI, scheduler: Scheduler) -> None:
    """Every error leaves as an OpenAI-shaped JSON body; a crash is logged and counted, never leaked."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), e.status_code)

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        scheduler.metrics.record("error")
        return JSONResponse(ApiError(500, "internal server error; the server log has the details", "server_error",
                                     code="internal_error").body(), 500)


def add_info_routes(app: FastAPI, scheduler: Scheduler, served: Served, started: int) -> None:
    """/health, /metrics and /v1/models."""

    @app.get("/health")
    async def health():
        body = {"status": "draining" if scheduler.draining else "ok", "model": served.ids[0],
                "queued": scheduler.queued, "running": scheduler.running}
        return JSONResponse(body, 503 if scheduler.draining else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(scheduler.render_metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def model_card(mid: str) -> dict:
        return {"id": mid, "object": "model", "created": started, "owned_by": "flashdraft",
                "max_model_len": served.context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(m) for m in served.ids]}

    @app.get("/v1/models/{mid:path}")
    async def model(mid: str):
        if mid not in served.ids:
            raise ApiError(404, f"the model {mid!r} does not exist", param="model", code="model_not_found")
        return model_card(mid)


async def stream_events(kind: str, rid: str, created: int, parsed: Parsed, job: Job,
                        scheduler: Scheduler) -> AsyncIterator[bytes]:
    """SSE: a role chunk, one chunk per accepted block's settled text, a final chunk with the stats, [DONE]."""
    limits, block_size = scheduler.limits, scheduler.worker.block_size
    if kind == "chat":
        yield sse(chunk_body(kind, rid, parsed.model, created, role=True))
    try:
        while True:
            event = await next_event(job, limits.request_timeout)
            if event[0] == "delta":
                yield sse(chunk_body(kind, rid, parsed.model, created, text=event[1]))
                continue
            out = terminal(*event, limits.request_timeout)
            break
    except ApiError as e:
        scheduler.finish(job, outcome_of(e.status))
        yield sse(e.body())
        yield sse("[DONE]")
        return
    scheduler.finish(job, "ok", out)
    final = chunk_body(kind, rid, parsed.model, created, text=None if kind == "chat" else "",
                       finish=out.extras["finish_reason"])
    final["flashdraft"] = extension(parsed.gen, out, block_size)
    yield sse(final)
    if parsed.include_usage:
        yield sse({"id": rid, "object": final["object"], "created": created, "model": parsed.model,
                   "choices": [], "usage": usage(parsed.gen, out)})
    yield sse("[DONE]")


def add_completion_routes(app: FastAPI, scheduler: Scheduler, served: Served, pool: ThreadPoolExecutor) -> None:
    """/v1/chat/completions and /v1/completions, streaming or not."""
    worker, limits = scheduler.worker, scheduler.limits

    async def admit(request: Request, kind: str, rid: str) -> tuple[Parsed, Job]:
        try:
            if scheduler.draining:
                raise ApiError(503, "the server is shutting down", "unavailable_error", code="shutting_down")
            raw = await read_body(request, limits.max_body, limits.body_timeout)
            parsed = await asyncio.get_running_loop().run_in_executor(
                pool, lambda: parse(kind, parse_json(raw), served))  # tokenizing a long prompt takes a while
            return parsed, scheduler.submit(parsed.gen, parsed.stream, rid)
        except ApiError as e:
            scheduler.metrics.record(outcome_of(e.status))
            raise

    async def handle(request: Request, kind: str):
        rid, created = new_id(kind), unix_time()
        parsed, job = await admit(request, kind, rid)
        if parsed.stream:
            return JobStream(stream_events(kind, rid, created, parsed, job, scheduler), job, scheduler)
        try:  # the worker sends a non-streaming job no deltas: the next event is the last
            out = terminal(*await next_event(job, limits.request_timeout, request), limits.request_timeout)
        except ApiError as e:
            scheduler.finish(job, outcome_of(e.status))
            raise
        except asyncio.CancelledError:  # the server cancelled the handler: the job must not keep its place
            scheduler.finish(job, "cancelled")
            raise
        except Exception:
            scheduler.finish(job, None)  # the crash handler counts it
            raise
        scheduler.finish(job, "ok", out)
        return completion_body(kind, rid, parsed.model, created, parsed.gen, out, worker.block_size)

    @app.post("/v1/chat/completions", summary="Chat completion (OpenAI)")
    async def chat_completions(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions", summary="Text completion (OpenAI)")
    async def completions(request: Request):
        return await handle(request, "text")


class GracefulServer(uvicorn.Server):
    """SIGTERM / Ctrl-C: refuse new work, let admitted work finish (up to --shutdown-timeout), then exit 0.

    uvicorn's own handler re-raises the signal after a clean shutdown, which would end the process with status 143.
    """

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler):
        super().__init__(config)
        self.scheduler = scheduler

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        self.should_exit = True
        self.scheduler.drain()
