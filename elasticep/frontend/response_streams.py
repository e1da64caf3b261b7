"""Answering with the events of submitted requests: an SSE stream, or whole results.

Both end every request they were given: a client that goes away, or one request that
fails, aborts the others on their ranks (closing a :class:`RequestStream` does that).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from elasticep.engine.request import TokenLogprobs
from elasticep.frontend.api_errors import OpenAIError, error_body
from elasticep.frontend.core import RequestStream
from elasticep.frontend.first_token_trace import FirstTokenTrace
from elasticep.frontend.merged_stream import MergedStream
from elasticep.frontend.metrics import FrontendMetrics
from elasticep.frontend.request_tracker import RequestEvent

logger = logging.getLogger(__name__)


@dataclass
class RequestResult:
    """One request's whole output, gathered from its events."""

    text: str
    num_tokens: int
    finish_reason: str | None
    error: str | None
    refused: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None

    @classmethod
    async def gather(cls, stream: RequestStream) -> RequestResult:
        """Read ``stream`` to its final event (closing it)."""
        parts: list[str] = []
        r = cls("", 0, None, "stream ended early")
        async with contextlib.aclosing(stream):
            async for event in stream:
                parts.append(event.text)
                r.token_ids += event.token_ids
                r.logprobs += event.logprobs
                if event.prompt_logprobs is not None:
                    r.prompt_logprobs = event.prompt_logprobs
                if event.finish_reason is not None:
                    r.num_tokens, r.finish_reason = event.num_generated, event.finish_reason
                    r.error, r.refused = event.error, event.refused
                    break
        r.text = "".join(parts)
        return r


class DisconnectAwareStreamingResponse(StreamingResponse):
    """Streams while listening for the client's disconnect, whatever the ASGI version.

    Starlette only listens for ``http.disconnect`` on old ASGI spec versions; otherwise a
    gone client is noticed at the next write, which never comes while a request waits
    (for example parked during an outage). Cancelling the body iterator on disconnect
    lets the request's stream abort it on its rank.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as group:
            async def run_stream() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(run_stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


def sse_response(stream: RequestStream | MergedStream, endpoint: str,
                 render: Callable[[RequestEvent], str | None],
                 tail: Callable[[int], str | None], metrics: FrontendMetrics,
                 trace: FirstTokenTrace | None = None) -> StreamingResponse:
    """An SSE response: ``render(event)`` per token event (None: no chunk), an error
    chunk if a request fails, ``tail(tokens)`` (if not None; ``tokens`` summed over
    the requests of a merged stream) once every request finished, then ``[DONE]``.
    ``endpoint`` labels the request metric in ``metrics``, and a request whose every
    member finished observes one end-to-end latency; ``trace`` (if given) is told when
    each request's first token was written.

    One chunk per token event, but one write for every event queued by then
    (``stream.ready()``): each write costs the loop the whole ASGI send path, more than
    rendering the events it carries, so a writer that fell behind catches up."""
    members = len(stream.streams) if isinstance(stream, MergedStream) else 1

    async def body() -> AsyncIterator[str]:
        outcome = "aborted"
        generated: dict[str, int] = {}
        finished: set[str] = set()
        written: set[str] = set()
        try:
            async with contextlib.aclosing(stream):
                async for event in stream:
                    lines: list[str] = []
                    first: list[str] = []  # requests whose first token this write carries
                    for e in (event, *stream.ready()):
                        if e.error is not None:
                            outcome = "error"
                            lines.append(_sse_line(_error_json(e)))
                            break
                        generated[e.request_id] = e.num_generated
                        if e.num_generated and e.request_id not in written:
                            written.add(e.request_id)
                            first.append(e.request_id)
                        line = render(e)
                        if line is not None:
                            lines.append(_sse_line(line))
                        if e.finish_reason is not None:
                            finished.add(e.request_id)
                            if len(finished) == members:
                                outcome = "finished"
                    if lines:
                        yield "".join(lines)
                    if trace is not None:  # resumed here: the chunk is out
                        for rid in first:
                            trace.written(rid)
                    if outcome == "error":
                        break
            num_tokens = sum(generated.values())
            if outcome == "finished":
                metrics.e2e_request_latency_seconds.observe(time.monotonic() - stream.started)
            last = tail(num_tokens) if outcome == "finished" else None
            yield ("" if last is None else _sse_line(last)) + "data: [DONE]\n\n"
        finally:
            metrics.requests.labels(endpoint, outcome).inc()

    return DisconnectAwareStreamingResponse(body(), media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})


async def collect_results(streams: list[RequestStream], raw: Request, endpoint: str,
                          metrics: FrontendMetrics) -> list[RequestResult]:
    """Gather every request's whole result, in order; all are aborted if the client
    disconnects, and the others once one fails. All of them are one HTTP request: one
    end-to-end latency in ``metrics`` once every one finished.

    Raises:
        OpenAIError: 499 (client gone), 400 (a request refused by its rank), 500 (a
            request failed).
    """

    async def gather_all() -> list[RequestResult]:
        tasks = [asyncio.create_task(RequestResult.gather(s)) for s in streams]
        try:
            results = []
            for t in tasks:  # in order; a failed one ends the wait for the rest
                results.append(await t)
                if results[-1].error:
                    break
            return results
        finally:
            for t in tasks:
                t.cancel()  # closes the stream, which aborts the request

    task = asyncio.create_task(gather_all())
    gone = asyncio.create_task(_wait_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        metrics.requests.labels(endpoint, "aborted").inc()
        logger.info("request %s: client disconnected; aborted", streams[0].request_id)
        raise OpenAIError(499, "client disconnected")
    results = task.result()
    failed = next((r for r in results if r.error), None)
    metrics.requests.labels(endpoint, "error" if failed else "finished").inc()
    if failed is None:
        metrics.e2e_request_latency_seconds.observe(
            time.monotonic() - min(s.started for s in streams))
    if failed is not None and failed.refused:  # the engine's own check: the client's error
        raise OpenAIError(400, failed.error or "request refused")
    if failed is not None:
        raise OpenAIError(500, failed.error or "request failed", type="server_error")
    return results


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _sse_line(data: str) -> str:
    return f"data: {data}\n\n"


def _error_json(event: RequestEvent) -> str:
    return json.dumps(error_body(event.error or "request failed",
                                 type="invalid_request_error" if event.refused
                                 else "server_error"))
