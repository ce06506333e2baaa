"""The FastAPI app: routes, error bodies in each API's own shape, and the worker's lifetime."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hearth.engine import Engine
from hearth.errors import HearthError
from hearth.kv.prompt_cache import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, PromptCache
from hearth.media.fetch import FetchPolicy
from hearth.server import anthropic, monitoring, openai, responses
from hearth.server.admission import BYTES_PER_GB, MemoryBudget
from hearth.server.errors import RequestError, error_response
from hearth.server.state import ClientGone, ServerDefaults, ServerState
from hearth.server.worker import GenerationWorker
from hearth.summary import held_weights

log = logging.getLogger("hearth.server")

# nginx's code for "client closed the request": logged only, the client is gone.
CLIENT_CLOSED_REQUEST = 499
# mlx_lm.server's default --allowed-origins: any.
DEFAULT_CORS_ORIGINS = ("*",)
BACKLOG = 2048  # uvicorn's default
DEFAULT_MAX_CONCURRENT = 8
# On a GPU: a batched decode step of 16 reads the weights once for 16 tokens (issue 43's
# 16-stream target), and its K/V pool at 16 requests still fits beside a 12B model on one card.
DEFAULT_GPU_CONCURRENT = 16


def default_concurrency(engine: Engine) -> int:
    """Requests a server runs at once unless told: 8 on a CPU (the reference system's
    default; a batched step of 8 gains 2.5x on a 4B model, see
    benchmarks/results/cpu_batched_decode-2026-12-07.md); 16 on a GPU, whose batched decode
    step runs over block tables from a CUDA graph per batch size (`runtime.batch_graphs`)."""
    return DEFAULT_GPU_CONCURRENT if engine.model.device.type == "cuda" else DEFAULT_MAX_CONCURRENT


def model_id_of(engine: Engine) -> str:
    """The served model's name: its file or directory name, without a .gguf suffix."""
    return engine.path.name.removesuffix(".gguf")


@dataclass(frozen=True)
class ServerLimits:
    """The prompt cache's size (either limit 0 turns it off), the optional memory budget, and
    how many requests run at once (None: the device's default, `default_concurrency`)."""

    prompt_cache_bytes: int = DEFAULT_MAX_BYTES
    prompt_cache_size: int = DEFAULT_MAX_ENTRIES
    memory_budget_gb: float | None = None
    max_concurrent: int | None = None
    kv_cache_memory_gb: float | None = None  # the paged K/V pool's size (None: see `kv_room`)

    def worker(self, engine: Engine) -> GenerationWorker:
        """The worker these limits give `engine`: with several requests at once, a scheduler
        on a paged K/V pool of `kv_room` bytes, its prefix cache on unless caching is off."""
        concurrency = self.max_concurrent or default_concurrency(engine)
        return GenerationWorker(engine, self.prompt_cache(), concurrency, self.kv_room(engine))

    def kv_room(self, engine: Engine) -> int | None:
        """The K/V pool's bytes: --kv-cache-memory, else what the memory budget leaves beside
        the weights, else None (the scheduler's default); ValueError where the pool would
        not fit the budget."""
        budget = self.memory_budget(engine)
        room = None if budget is None else budget.budget_bytes - budget.weight_bytes
        if self.kv_cache_memory_gb is None:
            return room
        pool = round(self.kv_cache_memory_gb * BYTES_PER_GB)
        if room is not None and pool > room:
            raise ValueError(
                f"--kv-cache-memory {self.kv_cache_memory_gb:g} GB does not fit beside the "
                f"weights in --memory-budget {self.memory_budget_gb:g} GB "
                f"({room / BYTES_PER_GB:.3g} GB left)"
            )
        return pool

    def prompt_cache(self) -> PromptCache | None:
        if self.prompt_cache_bytes == 0 or self.prompt_cache_size == 0:
            return None
        return PromptCache(self.prompt_cache_bytes, self.prompt_cache_size)

    def memory_budget(self, engine: Engine) -> MemoryBudget | None:
        """The budget, if one was given; ValueError if the weights alone exceed it (a server
        that could admit nothing)."""
        if self.memory_budget_gb is None:
            return None
        budget = MemoryBudget.for_engine(engine, self.memory_budget_gb)
        if budget.kv_token_capacity() == 0:
            raise ValueError(
                f"--memory-budget {self.memory_budget_gb:g} GB leaves no room for a KV cache "
                f"beside the weights' {budget.weight_bytes / BYTES_PER_GB:.3g} GB"
            )
        return budget


class CORSHeaders:
    """CORS as mlx_lm.server does it, so browser apps can call Hearth: any OPTIONS request is
    a preflight answered 204, and every response names the allowed origin (`*`, or the
    request's Origin when it is in the list) with any method and header allowed."""

    def __init__(self, app: ASGIApp, origins: Sequence[str]) -> None:
        self.app = app
        self.origins = tuple(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = self._headers(Headers(scope=scope).get("origin"))
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *headers]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _headers(self, origin: str | None) -> list[tuple[bytes, bytes]]:
        headers = [(b"access-control-allow-methods", b"*"), (b"access-control-allow-headers", b"*")]
        if "*" in self.origins:
            return [(b"access-control-allow-origin", b"*"), *headers]
        if origin is not None and origin in self.origins:
            allowed = [(b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin")]
            return allowed + headers
        return headers


def create_app(
    engine: Engine,
    defaults: ServerDefaults | None = None,
    limits: ServerLimits | None = None,
    worker: GenerationWorker | None = None,
    cors_origins: Sequence[str] = DEFAULT_CORS_ORIGINS,
    fetch: FetchPolicy | None = None,
) -> FastAPI:
    """The app; with no `worker` given, one is made and runs on its own thread.
    `cors_origins`: the origins browsers may call it from (`*`: any; empty: none). `fetch`:
    whether image and audio URLs are fetched (default: no; data: URLs always work)."""
    limits = limits or ServerLimits()
    own_worker = worker is None
    worker = worker or limits.worker(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if own_worker:
            worker.start()
        yield
        if own_worker:
            worker.stop()

    # Routes parse their bodies themselves (strictly): a generated schema would say nothing.
    app = FastAPI(
        title="Hearth", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None
    )
    budget = limits.memory_budget(engine)
    # A GPU decoder grown for a conversation stays within what the budget leaves for K/V.
    engine.runner.slot_limit = budget.kv_token_capacity() if budget else None
    app.state.hearth = ServerState(
        engine,
        worker,
        defaults or ServerDefaults(),
        model_id_of(engine),
        budget,
        fetch=fetch or FetchPolicy(),
    )
    # Read once here (a pass over the vocabulary, ~0.3 s), not on the event loop at the first
    # long prompt.
    engine.tokenizer.longest_token_chars  # noqa: B018
    app.include_router(openai.router)
    app.include_router(monitoring.router)
    app.include_router(anthropic.router)
    app.include_router(responses.router)
    app.state.response_store = responses.ResponseStore()
    _install_error_handlers(app)
    app.add_middleware(CORSHeaders, origins=cors_origins)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        return error_response(request, error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        # Unknown paths and wrong methods get the API's error shape, not FastAPI's {"detail"}.
        return error_response(request, RequestError(str(error.detail), status=error.status_code))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, error: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(ClientDisconnect)
    async def disconnected(request: Request, error: ClientDisconnect) -> Response:
        # Not a failure of ours: one line, no traceback (the reply goes nowhere).
        log.info(
            "%s %s: the client left before sending its whole request",
            request.method,
            request.url.path,
        )
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")  # the traceback stays in the server's log
        return error_response(request, RequestError(f"internal error: {error}", status=500))


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, for `serve`; HearthError, one line, where the address
    is taken or cannot be had. Listening holds the port (two bound sockets may share one):
    connections made while the model loads wait in the backlog until the server answers."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as error:
        raise HearthError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
        listener.listen(BACKLOG)
    except OSError as error:
        listener.close()
        raise HearthError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return listener


def serve(
    engine: Engine,
    listener: socket.socket,
    defaults: ServerDefaults | None = None,
    log_level: str = "INFO",
    limits: ServerLimits | None = None,
    load_seconds: float | None = None,
    shutdown_timeout: float = 5.0,
    cors_origins: Sequence[str] = DEFAULT_CORS_ORIGINS,
    fetch: FetchPolicy | None = None,
) -> int:
    """Serve on `listener` (see `listening_socket`) until interrupted: HTTP on a thread, the
    model on this (main) thread. The exit status: 0, or 1 if the HTTP server never started.

    The first SIGINT/SIGTERM stops admitting (the listener closes) and lets the requests in
    progress run for `shutdown_timeout` seconds; those still running then are cancelled. A
    second signal exits at once.
    """
    logging.basicConfig(level=log_level, format="%(asctime)s - %(levelname)s - %(message)s")
    limits = limits or ServerLimits()
    worker = limits.worker(engine)
    app = create_app(engine, defaults, limits, worker, cors_origins, fetch)
    config = uvicorn.Config(
        app, log_level=log_level.lower(), timeout_graceful_shutdown=shutdown_timeout
    )
    server = uvicorn.Server(config)
    _log_model(engine, load_seconds)
    log.info(
        "inputs: %s; image and audio URLs %s",
        ", ".join(engine.modalities),
        "fetched (public addresses only)" if fetch and fetch.allowed else "not fetched",
    )
    http = threading.Thread(target=_serve_http, args=(server, listener, worker), name="hearth-http")
    shutdown = _Shutdown(server, worker, shutdown_timeout)
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, shutdown.on_signal)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.01)
    if server.started:
        log.info("listening on %s", _url(listener))
    try:
        worker.run()  # until the HTTP thread ends (shut down, or failed to start)
    finally:
        server.should_exit = True
        http.join()
    return 0 if server.started else 1


def _serve_http(server: uvicorn.Server, listener: socket.socket, worker: GenerationWorker) -> None:
    try:
        server.run(sockets=[listener])
    except Exception as error:  # uvicorn has logged what it knows: one line here, no traceback
        log.error("the HTTP server stopped: %s", error)
    finally:
        worker.stop(timeout=0)  # no HTTP server: the model's loop ends too


class _Shutdown:
    """What SIGINT and SIGTERM do: the first drains (see `serve`), a second exits at once."""

    def __init__(self, server: uvicorn.Server, worker: GenerationWorker, grace: float) -> None:
        self.server, self.worker, self.grace = server, worker, grace

    def on_signal(self, signal_number: int, frame: object) -> None:
        if self.server.should_exit:
            log.warning("exiting now")
            os._exit(128 + signal_number)
        self.server.should_exit = True
        log.warning(
            "shutting down: %d request(s) draining, cancelled after %g s (Ctrl-C again exits "
            "at once)",
            self.worker.queue_depth,
            self.grace,
        )


def _log_model(engine: Engine, load_seconds: float | None) -> None:
    model = engine.model
    held = held_weights(model)
    weights = f"{held} weights, " if held else ""
    took = "" if load_seconds is None else f", loaded in {load_seconds:.1f} s"
    log.info(
        "model %s (%s, %scomputing in %s on %s)%s",
        engine.path,
        engine.format or "checkpoint",
        weights,
        str(model.compute_dtype).removeprefix("torch."),
        model.device,
        took,
    )
    if not engine.tokenizer.has_own_chat_template:
        log.warning(
            "%s has no chat template of its own: it is a base model, and the chat endpoints' "
            "replies will be poor (the completions endpoint suits it)",
            engine.path.name,
        )


def _url(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
