"""The probes' client (lab code): N streaming completions of a 300-token text prompt,
C at a time, each on a fresh connection; per request the status line's and the first
token's delay (seconds) and the number of SSE events."""
import asyncio
import json
import time


async def one(host, port, model, max_tokens, res):
    t0 = time.perf_counter()
    r, w = await asyncio.open_connection(host, port)
    body = json.dumps({"model": model, "prompt": "hello world " * 100,
                       "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                       "ignore_eos": True}).encode()
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await w.drain()
    await r.readline()
    t_status = time.perf_counter()
    t_first, n_events, tail = None, 0, b""
    while True:
        d = await r.read(65536)
        if not d:
            break
        if t_first is None and b'"text"' in d:
            t_first = time.perf_counter()
        n_events += (tail + d).count(b"data: {")
        tail = d[-8:]
    w.close()
    res.append((t_status - t0, t_first - t0, n_events))


async def burst(url, model, c, n, max_tokens=64):
    """``([(status_s, first_token_s, events), ...], wall_s)`` of ``n`` requests, ``c`` at
    a time."""
    host, port = url.split("//")[1].split(":")
    res, sem = [], asyncio.Semaphore(c)

    async def gated():
        async with sem:
            await one(host, int(port), model, max_tokens, res)
    t0 = time.perf_counter()
    await asyncio.gather(*(gated() for _ in range(n)))
    return res, time.perf_counter() - t0
