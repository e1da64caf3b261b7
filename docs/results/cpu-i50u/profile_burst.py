"""Lab probe (not product code): py-spy samples the stub server's front-end process
while C streaming completions start together, then prints the sampled time per
function (own and cumulative) from py-spy's raw stacks.

    PYTHONPATH=$PWD python docs/results/cpu-i50u/profile_burst.py C N OUT_PREFIX [S]
    python docs/results/cpu-i50u/profile_burst.py --summarize OUT_PREFIX

S: the stub ranks' steps per second (default 30). The first form writes py-spy's raw
stacks to OUT_PREFIX.raw and summarizes them; the second only summarizes.
"""
import asyncio
import collections
import statistics
import subprocess
import sys
import time

import httpx
from burst_client import burst

from elasticep_testkit.harness.serve_process import ServeProcess
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.serving import stub_engine

SUMMARIZE_ONLY = sys.argv[1] == "--summarize"
if SUMMARIZE_ONLY:
    OUT = sys.argv[2]
else:
    C, N, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


def record():
    steps_per_s = float(sys.argv[4]) if len(sys.argv) > 4 else 30.0
    serve = ServeProcess.start(["--model", str(DEMO_MODEL), "--device", "cpu", "--dtype",
                                "float32", "--load-format", "auto", "--ep-size", "1"],
                               program=stub_engine.server_command(steps_per_s))
    try:
        model = httpx.get(serve.url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(burst(serve.url, model, C, N))  # warm-up
        spy = subprocess.Popen([sys.executable.replace("python", "py-spy"), "record",
                                "--pid", str(serve.proc.pid), "--rate", "250", "--format",
                                "raw", "-o", OUT + ".raw", "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        res, wall = asyncio.run(burst(serve.url, model, C, N))
        spy.send_signal(2)
        spy.wait(30)
        print(f"C={C} N={N} stub steps/s {steps_per_s:g} wall {wall:.2f} s; status p50 "
              f"{statistics.median(r[0] for r in res) * 1e3:.1f} ms, first token p50 "
              f"{statistics.median(r[1] for r in res) * 1e3:.1f} ms")
    finally:
        serve.stop()


if not SUMMARIZE_ONLY:
    record()
own, cum, total = collections.Counter(), collections.Counter(), 0
for line in open(OUT + ".raw"):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n)
    frames = stack.split(";")
    if not frames or "(idle)" in stack:
        continue
    total += n
    own[frames[-1]] += n
    for f in set(frames):
        cum[f] += n
print(f"{total} busy samples")
for title, c in (("own", own), ("cumulative", cum)):
    print(f"-- top {title}")
    for f, n in c.most_common(40):
        print(f"{100 * n / total:5.1f}%  {f[:150]}")
