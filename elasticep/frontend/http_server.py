"""The HTTP front-end: a FastAPI app (OpenAI API, health, metrics, elastic control) and
a uvicorn runner.

Build it with :func:`build_app` around a :class:`Frontend`, then run it with
:class:`HttpServer` (``start()`` in a thread for tests and embedding, ``run()`` in the
main thread for ``serve``). Every error is OpenAI error JSON; a bad request never
raises out of a handler.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from elasticep.engine.llm_engine import EngineConfig, max_sequence_len
from elasticep.frontend.api_errors import OpenAIError, error_body, validation_message
from elasticep.frontend.core import Frontend, FrontendConfig
from elasticep.frontend.http_guards import ApiKeyMiddleware, BodyLimitMiddleware
from elasticep.frontend.membership_source import (
    MembershipSource,
)
from elasticep.frontend.openai_protocol import ChatCompletionRequest, CompletionRequest
from elasticep.frontend.openai_serving import OpenAIServing
from elasticep.frontend.scale_api import add_scale_routes
from elasticep.frontend.sglang_api import add_sglang_routes
from elasticep.frontend.tokenizer import load_tokenizer, streaming_decode
from elasticep.frontend.tool_parsers import parser_for_family
from elasticep.frontend_link import FrontendChannel
from elasticep.models.config import SamplingDefaults, load_model_config
from elasticep.utils.net import bind_tcp
from elasticep.utils.wait import wait_until

logger = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD_SIZE = 32 << 20  # bytes: far above any prompt of a long context


@dataclass(frozen=True)
class ServerConfig:
    """HTTP settings.

    Attributes:
        model_name: the ``model`` clients send (and /v1/models lists).
        max_model_len: prompt + completion limit in tokens: the engine's own
            (:func:`~elasticep.engine.llm_engine.max_sequence_len`).
        sampling_defaults: the model's ``generation_config.json`` sampling values, for
            the fields a request leaves unset.
        api_key: if set, every endpoint but ``/health`` needs
            ``Authorization: Bearer <api_key>``.
        model_path: the checkpoint directory (SGLang's ``/get_model_info`` names it).
        host: interface to bind; 127.0.0.1 unless an api key protects the server.
        port: TCP port; 0 picks a free one.
        max_payload_size: largest request body in bytes; a larger one gets 413
            (``serve --max-payload-size``, the name of SGLang's router flag).
        metrics_api_key: ``/metrics``' own bearer token (see :class:`~elasticep.frontend.http_guards.ApiKeyMiddleware`).
        tool_call_parser: the model's tool-call format on chat completions (a key of
            :data:`~elasticep.frontend.tool_parsers.TOOL_CALL_PARSERS`); None: none.
    """

    model_name: str
    max_model_len: int
    api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    model_path: str = ""
    max_payload_size: int = DEFAULT_MAX_PAYLOAD_SIZE
    metrics_api_key: str | None = None
    tool_call_parser: str | None = None


# metric label per routed path: the same names the finished requests use
_ENDPOINT_LABELS = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
                    "/generate": "generate"}


def build_app(frontend: Frontend, tokenizer: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops ``frontend``'s background tasks."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await frontend.start()
        logger.info("front-end serving %s (max_model_len %d)", config.model_name,
                    config.max_model_len)
        try:
            yield
        finally:
            await frontend.stop()

    app = FastAPI(title="ElasticEP", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    serving = OpenAIServing(frontend, tokenizer, config.model_name, config.max_model_len,
                            config.sampling_defaults, config.tool_call_parser)
    created = int(time.time())
    app.add_middleware(BodyLimitMiddleware, limit=config.max_payload_size)
    if config.api_key or config.metrics_api_key:  # outermost: no body read before the key
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key,
                           metrics_api_key=config.metrics_api_key)

    def count_rejected(request: Request, status: int) -> None:
        # one label per route, named by its template ("/v1/models/{model_id:path}"): a
        # label per requested path would grow without bound
        route = request.scope.get("route")
        if 400 <= status < 500 and status != 499 and route is not None:
            path = getattr(route, "path", request.url.path)
            frontend.metrics.requests.labels(_ENDPOINT_LABELS.get(path, path), "rejected").inc()

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        count_rejected(request, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        count_rejected(request, 400)
        message, param = validation_message(exc, request.headers.get("content-type", ""))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request handler")
        return JSONResponse(error_body(f"internal error: {exc!r}", type="server_error"),
                            status_code=500)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(req, raw)

    add_sglang_routes(app, serving, config)  # /generate, /get_server_info, /get_model_info
    add_scale_routes(app, frontend)  # POST /scale_elastic_ep, GET /scale_elastic_ep/{id}

    model_card = {"id": config.model_name, "object": "model", "created": created,
                  "owned_by": "elasticep", "max_model_len": config.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")  # ids may hold '/' (org/name)
    async def model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)
        return model_card

    @app.api_route("/health", methods=["GET", "HEAD"])  # some probes only send HEAD
    async def health() -> JSONResponse:
        # 503 until started (as SGLang and vLLM), then 200 while any rank can serve
        status = frontend.status()
        can_serve = frontend.ready and frontend.can_serve()
        body = {"status": ("ok" if can_serve else "unavailable" if frontend.ready
                           else "starting"),
                "degraded": not can_serve or status.degraded(),
                "epoch": status.epoch, "ep_size": status.ep_size,
                "healthy_ranks": len(status.healthy_ranks()),
                "running_requests": frontend.tracker.num_running}
        waiting = frontend.waiting_for_joiners()
        if waiting is not None:  # a grow needs `join`: say which slots, and how
            body["waiting_for_joiners"] = waiting
        store = status.membership_store
        if store is not None and not store.ok:  # serving goes on; no change is kept
            body["degraded"] = True
            body["membership_store"] = store.reason
        if frontend.closed_reason is not None:  # the deployment is stopping
            body["reason"] = frontend.closed_reason
        elif not frontend.ready:
            body["reason"] = (f"starting: {len(frontend.tracker.healthy_ranks())} of "
                              f"{status.ep_size} ranks ready")
        return JSONResponse(body, status_code=200 if can_serve else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = frontend.metrics.render()
        return Response(data, media_type=content_type)

    @app.get("/debug/first_token_trace")
    async def first_token_trace(reset: bool = False) -> dict[str, Any]:
        # where first tokens spent their time (frontend/first_token_trace.py); the
        # benchmark resets it before its measured run and reads it after. The pid tells
        # the node's front-end processes apart (--api-server-count): each traces its own
        return {**frontend.first_token_trace.summary(reset=reset), "pid": os.getpid()}

    @app.get("/elastic_ep_status")
    async def elastic_ep_status() -> dict[str, Any]:
        return {**frontend.status().to_dict(), **frontend.status_extra()}

    return app


def create_server(model_path: str | Path, channel: FrontendChannel,
                  membership: MembershipSource, *, served_model_name: str | None = None,
                  api_key: str | None = None, host: str = "127.0.0.1", port: int = 0,
                  max_total_tokens: int | None = None,
                  frontend_config: FrontendConfig | None = None,
                  max_payload_size: int = DEFAULT_MAX_PAYLOAD_SIZE,
                  sock: socket.socket | None = None,
                  metrics_api_key: str | None = None,
                  tool_call_parser: str | None = None,
                  ) -> tuple[HttpServer, Frontend]:
    """Everything the serve glue needs: tokenizer, limits, Frontend, app and server.

    Args:
        model_path: HF checkpoint directory (tokenizer files and config.json).
        channel: the bound front-end link channel (workers connect to its endpoints).
        membership: rank states and scaling.
        served_model_name: the ``model`` name clients use; default: ``model_path``.
        api_key: protect every endpoint but ``/health`` with this bearer token.
        host: interface to bind.
        port: TCP port; 0 picks a free one (read it back from ``server.port``).
        max_total_tokens: per-rank KV-cache capacity in tokens, if smaller than the context.
        frontend_config: timing of the front-end core.
        max_payload_size: largest request body in bytes (413 above it).
        sock: the socket bound to ``host:port`` ahead of time, or None (see HttpServer).
        metrics_api_key: ``/metrics``' own bearer token (see :class:`~elasticep.frontend.http_guards.ApiKeyMiddleware`).
        tool_call_parser: the tool-call format (``serve --tool-call-parser``); None: the
            one the model family's chat template implies, if any.

    Returns:
        The (not yet started) server and its front-end.
    """
    tokenizer = load_tokenizer(model_path)
    # the engine's own limit, so that what it would refuse or cut short is a 400 up front
    model_config = load_model_config(model_path)
    max_model_len = max_sequence_len(
        model_config, EngineConfig(max_total_tokens=max_total_tokens) if max_total_tokens else None)
    # Prompt lengths are checked against max_model_len with a clear 400; the tokenizer's
    # own limit would only print a transformers warning into the server log.
    tokenizer.model_max_length = 1 << 62
    frontend = Frontend(channel, membership, streaming_decode(tokenizer),
                        config=frontend_config,
                        decode_with=lambda ids, **options: tokenizer.decode(ids, **options))
    config = ServerConfig(model_name=served_model_name or str(model_path),
                          max_model_len=max_model_len, api_key=api_key, host=host, port=port,
                          sampling_defaults=model_config.sampling_defaults,
                          model_path=str(model_path), max_payload_size=max_payload_size,
                          metrics_api_key=metrics_api_key,
                          tool_call_parser=tool_call_parser
                          or parser_for_family(model_config.model_type))
    app = build_app(frontend, tokenizer, config)
    return HttpServer(app, host=host, port=port, sock=sock), frontend


class HttpServer:
    """Runs an app under uvicorn on a socket bound at construction (so the port is known).

    Args:
        app: the ASGI app.
        host: interface.
        port: TCP port; 0 picks a free one.
        graceful_timeout_s: how long open streams may delay shutdown (seconds).
        sock: a socket already bound to ``host:port`` (:func:`elasticep.utils.net.bind_tcp`),
            which the server then owns; None: bind one here.

    Raises:
        OSError: ``sock`` is None and ``host:port`` cannot be bound.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 graceful_timeout_s: float = 5.0, sock: socket.socket | None = None) -> None:
        self._sock = bind_tcp(host, port) if sock is None else sock
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", lifespan="on",
            timeout_graceful_shutdown=int(graceful_timeout_s)))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve in this thread until SIGINT/SIGTERM (uvicorn installs the handlers)."""
        self._server.run(sockets=[self._sock])

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve in a daemon thread; return once the server accepts connections.

        Raises:
            TimeoutError: it did not start within ``timeout_s`` seconds.
        """
        self._thread = threading.Thread(target=self.run, name="http-server", daemon=True)
        self._thread.start()
        def started() -> bool:
            if not self._thread.is_alive():
                raise TimeoutError("HTTP server thread exited before it started")
            return self._server.started

        wait_until(started, timeout_s, "the HTTP server to start", poll_s=0.01)
        logger.info("HTTP server ready at %s", self.url)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the server to exit and wait up to ``timeout_s`` seconds for it."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("HTTP server thread still alive after %s s", timeout_s)
        self._sock.close()
