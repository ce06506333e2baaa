"""The FastAPI app: routes, error bodies in each API's own shape, and the worker's lifetime."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from hearth.engine import Engine
from hearth.kv.prompt_cache import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, PromptCache
from hearth.server import anthropic, monitoring, openai, responses
from hearth.server.admission import BYTES_PER_GB, MemoryBudget
from hearth.server.errors import RequestError, error_response
from hearth.server.state import ClientGone, ServerDefaults, ServerState
from hearth.server.worker import GenerationWorker

log = logging.getLogger("hearth.server")

# nginx's code for "client closed the request": logged only, the client is gone.
CLIENT_CLOSED_REQUEST = 499


def model_id_of(engine: Engine) -> str:
    """The served model's name: its file or directory name, without a .gguf suffix."""
    return engine.path.name.removesuffix(".gguf")


@dataclass(frozen=True)
class ServerLimits:
    """The prompt cache's size (either limit 0 turns it off) and the optional memory budget."""

    prompt_cache_bytes: int = DEFAULT_MAX_BYTES
    prompt_cache_size: int = DEFAULT_MAX_ENTRIES
    memory_budget_gb: float | None = None

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


def create_app(
    engine: Engine,
    defaults: ServerDefaults | None = None,
    limits: ServerLimits | None = None,
    worker: GenerationWorker | None = None,
) -> FastAPI:
    """The app; with no `worker` given, one is made and runs on its own thread."""
    limits = limits or ServerLimits()
    own_worker = worker is None
    worker = worker or GenerationWorker(engine, limits.prompt_cache())

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
        engine, worker, defaults or ServerDefaults(), model_id_of(engine), budget
    )
    app.include_router(openai.router)
    app.include_router(monitoring.router)
    app.include_router(anthropic.router)
    app.include_router(responses.router)
    app.state.response_store = responses.ResponseStore()
    _install_error_handlers(app)
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

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")  # the traceback stays in the server's log
        return error_response(request, RequestError(f"internal error: {error}", status=500))


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8080,
    defaults: ServerDefaults | None = None,
    log_level: str = "INFO",
    limits: ServerLimits | None = None,
) -> None:
    """Run the server until interrupted: HTTP on a thread, the model on this (main) thread."""
    logging.basicConfig(level=log_level, format="%(asctime)s - %(levelname)s - %(message)s")
    limits = limits or ServerLimits()
    worker = GenerationWorker(engine, limits.prompt_cache())
    app = create_app(engine, defaults, limits, worker)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower()))
    http = threading.Thread(target=server.run, name="hearth-http")
    http.start()
    # Ctrl-C and SIGTERM end the generation loop; then the HTTP thread is told to finish.
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, lambda *_: worker.stop(timeout=0))
    try:
        worker.run()
    finally:
        server.should_exit = True
        http.join()
