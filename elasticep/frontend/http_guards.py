"""The pure-ASGI guards in front of every route of the front-end: the bearer-token check
(:class:`ApiKeyMiddleware`) and the request body cap (:class:`BodyLimitMiddleware`).

Pure ASGI, not Starlette's ``BaseHTTPMiddleware``, which breaks the cancellation of a
stream when its client goes away.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse

from elasticep.frontend.api_errors import error_body

OPEN_PATHS = frozenset({"/health"})

METRICS_PATH = "/metrics"


class ApiKeyMiddleware:
    """Pure-ASGI bearer-token check (no BaseHTTPMiddleware: it breaks stream cancellation).

    ``/health`` is open. ``/metrics`` takes ``metrics_api_key`` where given (a scraper
    then holds no API key), else the API key. Every other path takes the API key.

    Args:
        api_key: the API's key, or None (only ``/metrics`` is checked).
        metrics_api_key: ``/metrics``' own key, or None.
    """

    def __init__(self, app: Any, api_key: str | None, metrics_api_key: str | None = None,
                 ) -> None:
        self.app = app
        self._expected = None if api_key is None else api_key.encode()
        self._metrics = None if metrics_api_key is None else metrics_api_key.encode()

    def _key_for(self, scope: Any) -> bytes | None:
        """The key this request needs, or None (open)."""
        if scope.get("path") in OPEN_PATHS:
            return None
        if scope.get("path") == METRICS_PATH and self._metrics is not None:
            return self._metrics
        return self._expected

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # /health stays open: load balancers probe it without credentials (as vLLM's).
        expected = self._key_for(scope) if scope["type"] == "http" else None
        if expected is not None:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            # the scheme is case-insensitive (RFC 9110 section 11.1)
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(),
                                                                      expected):
                response = JSONResponse(
                    error_body("Invalid or missing API key (use 'Authorization: Bearer <key>').",
                               code="invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Pure-ASGI cap on request bodies: 413 for one over ``limit`` bytes, before any of
    it is parsed (a declared Content-Length is refused at once; a chunked body is read
    up to the limit, then replayed to the app)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def _refuse(self, size: str, scope: Any, receive: Any, send: Any) -> None:
        response = JSONResponse(
            error_body(f"request body of {size} bytes exceeds --max-payload-size "
                       f"({self.limit} bytes)", code="payload_too_large"), status_code=413)
        await response(scope, receive, send)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.limit:
                await self._refuse(declared.decode(), scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server holds it to its length
            return
        messages, size = [], 0
        while True:  # chunked: buffer up to the limit
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse(f"more than {self.limit}", scope, receive, send)
                return
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
