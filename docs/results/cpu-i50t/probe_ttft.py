import asyncio, json, sys, time, statistics
from elasticep_testkit.harness.serve_process import ServeProcess
from elasticep_testkit.serving import stub_engine
from elasticep_testkit.serving.datasets import random_requests
C = int(sys.argv[1]); N = int(sys.argv[2]) if len(sys.argv) > 2 else 2 * C
async def one(host, port, prompt, res):
    t0 = time.perf_counter()
    r, w = await asyncio.open_connection(host, port)
    t_conn = time.perf_counter()
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0.0, "stream": True, "ignore_eos": True}).encode()
    w.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await w.drain()
    await r.readline(); t_status = time.perf_counter()
    while (await r.readline()) not in (b"\r\n", b""): pass
    t_first = None
    buf = b""
    while True:
        d = await r.read(65536)
        if not d: break
        if t_first is None and b'"text"' in d: t_first = time.perf_counter()
    w.close()
    res.append((t_conn - t0, t_status - t0, t_first - t0))
async def main(url):
    global MODEL
    import httpx
    MODEL = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    host, port = url.split("//")[1].split(":"); port = int(port)
    reqs = ["hello world " * 100 for _ in range(N)]
    res = []; sem = asyncio.Semaphore(C)
    async def gated(p):
        async with sem: await one(host, port, p, res)
    await asyncio.gather(*(gated(p) for p in reqs))
    for i, name in enumerate(("connect", "status", "first")):
        print(name, round(statistics.median(x[i] for x in res) * 1000, 2), "ms p50")
serve = ServeProcess.start(["--model", str(__import__("elasticep_testkit.paths",fromlist=["x"]).DEMO_MODEL), "--device", "cpu", "--dtype", "float32", "--load-format", "auto", "--ep-size", "1"], program=stub_engine.server_command(30.0))
try:
    import httpx
    asyncio.run(main(serve.url))
    print(httpx.get(serve.url + "/debug/first_token_trace").json()["total_ms"])
finally:
    serve.stop()
