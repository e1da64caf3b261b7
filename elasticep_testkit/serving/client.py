"""An asyncio streaming client of ``POST /v1/completions`` for the serving benchmark
(plain asyncio streams, one connection per request, as bench_serving's aiohttp session
per request).

Requests arrive as a Poisson process of ``request_rate`` per second (``inf``: all at
once), at most ``max_concurrency`` in flight, as SGLang's ``bench_serving`` sends them.
Every request streams greedily (``temperature 0``) with ``stream_options.include_usage``,
so the output token count is the server's own (``usage.completion_tokens``); where a
server sends no usage, one token per SSE event that carries a choice. A server started
with ``--api-key`` takes the key from ``$OPENAI_API_KEY``, as bench_serving does.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import numpy as np

from elasticep_testkit.serving.datasets import BenchRequest
from elasticep_testkit.serving.metrics import RequestResult


def request_body(model: str, req: BenchRequest, ignore_eos: bool) -> dict:
    """The JSON body of one streaming completion."""
    return {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos}


def auth_header() -> str:
    """``Authorization: Bearer $OPENAI_API_KEY`` plus CRLF when that variable is set (as
    bench_serving reads it), else ""."""
    key = os.environ.get("OPENAI_API_KEY")
    return f"Authorization: Bearer {key}\r\n" if key else ""


class _HttpError(Exception):
    """A response the client could not use (status, framing)."""


class _FrontendLost(Exception):
    """The stream broke before its ``[DONE]``: the front-end is gone (or cut off)."""


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]):
    """Yield the body of a response in pieces (chunked, sized, or to EOF)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            line = await reader.readline()
            if not line:  # closed before the last chunk: the server is gone
                raise _FrontendLost("the connection closed inside the body")
            size = int(line.split(b";", 1)[0], 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the CRLF after each chunk
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()


async def _post_stream(host: str, port: int, path: str, body: dict):
    """POST ``body`` as JSON over a fresh HTTP/1.1 connection; yield (status, pieces).

    A minimal client on purpose: at thousands of SSE events a second, httpx's per-event
    cost (about 0.2 ms of CPU here) made the client, not the server, the limit.
    """
    reader, writer = await asyncio.open_connection(host, port)
    try:
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                     f"{auth_header()}"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                     .encode() + data)
        await writer.drain()
        status_line = await reader.readline()
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise _HttpError(f"not an HTTP response: {status_line[:80]!r}")
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        yield int(parts[1]), _read_body(reader, headers)
    finally:
        writer.close()


async def _stream_events(base: tuple[str, int], model: str, req: BenchRequest,
                         ignore_eos: bool, messages: list[tuple[float, bool]],
                         ) -> tuple[dict | None, str | None]:
    """Stream one request from ``base``, appending its messages' times to ``messages``;
    returns (usage, the server's error). Raises ``OSError``,
    ``asyncio.IncompleteReadError`` or :class:`_FrontendLost` when the connection is
    refused or breaks, ``ValueError`` or ``_HttpError`` for an answer it cannot read."""
    usage = error = None
    async for status, pieces in _post_stream(*base, "/v1/completions",
                                             request_body(model, req, ignore_eos)):
        if status != 200:
            body = b"".join([p async for p in pieces]).decode(errors="replace")
            return None, f"HTTP {status}: {body[:300]}"
        buf, done = b"", False
        async for piece in pieces:
            now = time.perf_counter()  # every message of this piece arrived by now
            buf += piece
            *complete, buf = buf.split(b"\n\n")
            for message in complete:
                if not message.startswith(b"data: "):
                    continue
                data = message[6:]
                if data == b"[DONE]":
                    messages.append((now, False))
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    error = str(chunk["error"].get("message", chunk["error"]))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                messages.append((now, "error" not in chunk and bool(chunk.get("choices"))))
        if not done and error is None:
            raise _FrontendLost("the stream ended before [DONE]")
    return usage, error


async def stream_one(bases: Sequence[tuple[str, int]], model: str, req: BenchRequest,
                     ignore_eos: bool, first: int = 0) -> RequestResult:
    """Send one request to ``bases[first]`` (host, port) and time its events; errors are
    recorded, never raised. A request that loses its front-end (connection refused or
    broken before the stream's end) is sent again, whole, to the next endpoint, once
    per endpoint: its times count from the first send, its events are the last try's."""
    start = time.perf_counter()
    for attempt in range(len(bases)):
        messages: list[tuple[float, bool]] = []  # (arrival, is a token event): see metrics
        usage = None
        try:
            usage, error = await _stream_events(bases[(first + attempt) % len(bases)],
                                                model, req, ignore_eos, messages)
            break
        except (OSError, asyncio.IncompleteReadError, _FrontendLost) as exc:
            error = repr(exc)  # the front-end is gone: the next one, if any
        except (ValueError, _HttpError) as exc:
            error = repr(exc)
            break
    res = RequestResult.from_events(req.prompt_len, start, messages)
    res.error = error
    events = sum(is_token for _, is_token in messages)
    if usage is not None:
        res.output_tokens = int(usage["completion_tokens"])
        res.prompt_len = int(usage["prompt_tokens"])
    else:
        res.output_tokens = events
    if res.error is None and events == 0:
        res.error = "the stream ended without a token"
    return res


def arrival_gaps(n: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: 0 for ``inf``, else exponential gaps of
    mean ``1 / request_rate`` (a Poisson process).

    Raises:
        ValueError: ``request_rate`` is not positive.
    """
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return [float(x) for x in rng.exponential(1.0 / request_rate, size=n)]


def parse_base_urls(base_urls: str | Sequence[str]) -> list[tuple[str, int]]:
    """``http://HOST:PORT`` (one, or several: a deployment's front-ends) as (host, port).

    Raises:
        ValueError: one is not ``http://HOST:PORT``, or none is given.
    """
    urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
    if not urls:
        raise ValueError("no base URL given")
    out = []
    for base_url in urls:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"base URL must be http://HOST:PORT, got {base_url!r}")
        out.append((url.hostname, url.port or 80))
    return out


async def run_requests(base_url: str | Sequence[str], model: str,
                       requests: Sequence[BenchRequest], *,
                       request_rate: float, max_concurrency: int | None, ignore_eos: bool,
                       seed: int, timeout_s: float) -> tuple[list[RequestResult], float]:
    """Send every request; return their results (in request order) and the duration.

    Args:
        base_url: ``http://HOST:PORT`` of the server, or of each of a deployment's
            front-ends: request ``i`` goes to the ``i``-th (modulo their number) and
            moves to the next one if it loses its own (:func:`stream_one`).
        model: the served model id.
        requests: what to send.
        request_rate: arrivals per second (``inf``: all at once).
        max_concurrency: most requests in flight (None: no cap).
        ignore_eos: ask for exactly ``output_len`` tokens.
        seed: of the arrival process.
        timeout_s: most seconds one request may take; a hang becomes an error.

    Raises:
        ValueError: ``base_url`` is not ``http://HOST:PORT``, or a bad request rate.

    Returns:
        (results, seconds from the first send to the last end).
    """
    gaps = arrival_gaps(len(requests), request_rate, seed)
    cap = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    bases = parse_base_urls(base_url)

    async def one(i: int, req: BenchRequest) -> RequestResult:
        async with cap:
            try:
                return await asyncio.wait_for(
                    stream_one(bases, model, req, ignore_eos, first=i % len(bases)),
                    timeout_s)
            except asyncio.TimeoutError:
                return RequestResult(req.prompt_len, error=f"no answer within {timeout_s} s")

    tasks = []
    t0 = time.perf_counter()
    for i, (gap, req) in enumerate(zip(gaps, requests, strict=True)):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(i, req)))
    results = list(await asyncio.gather(*tasks))
    end = max((r.start + r.e2e for r in results), default=t0)
    return results, max(end - t0, 1e-9)
