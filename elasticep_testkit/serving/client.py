"""An asyncio streaming client of ``POST /v1/completions`` for the serving benchmark.

Requests arrive as a Poisson process of ``request_rate`` per second (``inf``: all at
once), at most ``max_concurrency`` in flight, as SGLang's ``bench_serving`` sends them.
Every request streams greedily (``temperature 0``) with ``stream_options.include_usage``,
so the output token count is the server's own (``usage.completion_tokens``); where a
server sends no usage, one token per SSE event that carries a choice.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence

import httpx
import numpy as np

from elasticep_testkit.serving.datasets import BenchRequest
from elasticep_testkit.serving.metrics import RequestResult


def request_body(model: str, req: BenchRequest, ignore_eos: bool) -> dict:
    """The JSON body of one streaming completion."""
    return {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos}


async def stream_one(http: httpx.AsyncClient, model: str, req: BenchRequest,
                     ignore_eos: bool) -> RequestResult:
    """Send one request and time its events; errors are recorded, never raised."""
    res = RequestResult(prompt_len=req.prompt_len)
    res.start = last = time.perf_counter()
    events = 0
    usage = None
    try:
        async with http.stream("POST", "/v1/completions",
                               json=request_body(model, req, ignore_eos)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))
                    break
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if events == 0:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - last)
                last = now
                events += 1
    except (httpx.HTTPError, OSError, ValueError) as exc:
        res.error = repr(exc)
    res.e2e = last - res.start
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


async def run_requests(base_url: str, model: str, requests: Sequence[BenchRequest], *,
                       request_rate: float, max_concurrency: int | None, ignore_eos: bool,
                       seed: int, timeout_s: float) -> tuple[list[RequestResult], float]:
    """Send every request; return their results (in request order) and the duration.

    Args:
        base_url: ``http://HOST:PORT`` of the server.
        model: the served model id.
        requests: what to send.
        request_rate: arrivals per second (``inf``: all at once).
        max_concurrency: most requests in flight (None: no cap).
        ignore_eos: ask for exactly ``output_len`` tokens.
        seed: of the arrival process.
        timeout_s: per request (connect, and each read); a hang becomes an error.

    Returns:
        (results, seconds from the first send to the last end).
    """
    gaps = arrival_gaps(len(requests), request_rate, seed)
    cap = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as http:

        async def one(req: BenchRequest) -> RequestResult:
            async with cap:
                return await stream_one(http, model, req, ignore_eos)

        tasks = []
        t0 = time.perf_counter()
        for gap, req in zip(gaps, requests, strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
    end = max((r.start + r.e2e for r in results), default=t0)
    return results, max(end - t0, 1e-9)
