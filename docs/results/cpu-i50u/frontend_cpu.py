"""Lab probe (not product code): the front-end process's CPU time per streamed token
under a burst, over the stub ranks (`elasticep_testkit.serving.stub_serve`).

C streaming completions at a time, N in all, each of a 300-token prompt and M tokens,
on fresh connections. The stub ranks step S times a second, fast enough that the
front-end's thread, not the ranks, sets the pace. Prints one JSON line: the front-end
process's CPU seconds (utime + stime from /proc) during the measured burst, per token
event, the burst's wall time, tok/s, and first-token and status-line p50/p99.

    PYTHONPATH=$PWD python docs/results/cpu-i50u/frontend_cpu.py C N M S LABEL
"""
import asyncio
import json
import os
import statistics
import sys

import httpx
from burst_client import burst

from elasticep_testkit.harness.serve_process import ServeProcess
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.serving import stub_engine

C, N, M, S, LABEL = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                     float(sys.argv[4]), sys.argv[5])


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


serve = ServeProcess.start(["--model", str(DEMO_MODEL), "--device", "cpu", "--dtype",
                            "float32", "--load-format", "auto", "--ep-size", "1"],
                           program=stub_engine.server_command(S))
try:
    model = httpx.get(serve.url + "/v1/models").json()["data"][0]["id"]
    asyncio.run(burst(serve.url, model, C, C, M))  # warm-up
    c0 = cpu_s(serve.proc.pid)
    res, wall = asyncio.run(burst(serve.url, model, C, N, M))
    used = cpu_s(serve.proc.pid) - c0
finally:
    serve.stop()
events = sum(r[2] for r in res)

try:
    import uvloop  # noqa: F401
    loop = "uvloop"
except ImportError:
    loop = "asyncio"
try:
    import httptools  # noqa: F401
    http = "httptools"
except ImportError:
    http = "h11"
print(json.dumps({"label": LABEL, "loop": loop, "http": http, "C": C, "N": N,
                  "max_tokens": M, "stub_steps_per_s": S, "events": events,
                  "frontend_cpu_s": round(used, 3),
                  "cpu_us_per_event": round(1e6 * used / max(events, 1), 1),
                  "wall_s": round(wall, 3), "tok_per_s": round(events / wall, 1),
                  "status_p50_ms": round(1e3 * statistics.median(r[0] for r in res), 1),
                  "first_token_p50_ms": round(1e3 * statistics.median(r[1] for r in res), 1),
                  "first_token_p99_ms": round(1e3 * pct([r[1] for r in res], 0.99), 1)}))
