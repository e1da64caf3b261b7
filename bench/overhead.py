"""What elasticity costs with no fault: tokens/s of backend elastic against none.

Steady-state tokens/s of `serve --elastic-ep-backend elastic` against `none` (plain
groups), same model and load, one run. Prints one JSON line.

Usage: python -m bench.overhead [--ep-size 4] [--repeats 5] [--window-s 8]
       [--concurrency 8] [--max-tokens 64] [--device cpu|cuda]

Both deployments are started once and stay up; repetitions alternate A/B and B/A so
drift (other processes, thermal) hits both alike. While one is measured the other is
idle; ``idle_cpu_s`` reports the CPU seconds the idle one's processes used meanwhile, so a
busy-waiting idle deployment would show. Medians are reported with the spread
(max - min over the repetitions, as a fraction of the median): a ratio whose distance
from 1 is below the spread is noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench._commit import commit
from bench._deploy import (
    REQUEST_TIMEOUT_S,
    add_deploy_arguments,
    cuda_graph_on,
    deployment_args,
    machine,
)
from elasticep_testkit.harness import timeline
from elasticep_testkit.harness.load import SteadyLoad, make_client
from elasticep_testkit.harness.serve_process import ServeProcess
from elasticep_testkit.prompts import gsm8k_prompts

BACKENDS = ("elastic", "none")


def cpu_seconds(pids: set[int]) -> float:
    """User + system CPU seconds used so far by the live ``pids``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
        except (OSError, IndexError, ValueError):
            continue
    return total / tick


def measure(serve: ServeProcess, prompts: list[str], args: argparse.Namespace
            ) -> tuple[float, dict[int, str]]:
    """One repetition: warm up, count tokens over the window; returns (tokens/s, texts of
    the completed requests by prompt index)."""
    client = make_client(serve.url, REQUEST_TIMEOUT_S)
    load = SteadyLoad(client, serve.model_name(), prompts, args.concurrency, args.max_tokens)
    t0 = time.monotonic() + args.warmup_s
    time.sleep(args.warmup_s + args.window_s)
    records = load.stop(REQUEST_TIMEOUT_S + 10)
    if any(r.error for r in records):
        raise RuntimeError(f"request failed without a fault: {next(r for r in records if r.error)}")
    texts = {r.prompt_idx: r.text for r in records if r.complete(args.max_tokens)}
    return timeline.tokens_per_s(records, t0, t0 + args.window_s), texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="A/B pairs")
    ap.add_argument("--window-s", type=float, default=8.0, help="measured seconds per run")
    add_deploy_arguments(ap)
    args = ap.parse_args()
    prompts = gsm8k_prompts(args.num_prompts)
    serves: dict[str, ServeProcess] = {}
    runs: dict[str, list[float]] = {b: [] for b in BACKENDS}
    idle_cpu: dict[str, list[float]] = {b: [] for b in BACKENDS}
    texts: dict[str, dict[int, str]] = {b: {} for b in BACKENDS}
    orphans: list[int] = []
    try:
        for b in BACKENDS:
            serves[b] = ServeProcess.start(deployment_args(args) + ["--elastic-ep-backend", b])
        for rep in range(args.repeats):
            order = BACKENDS if rep % 2 == 0 else BACKENDS[::-1]
            for b in order:
                other = serves[BACKENDS[1 - BACKENDS.index(b)]]
                idle_pids = other.note_descendants() | {other.proc.pid}
                c0 = cpu_seconds(idle_pids)
                tps, done = measure(serves[b], prompts, args)
                idle_cpu[b].append(cpu_seconds(idle_pids) - c0)
                runs[b].append(tps)
                texts[b].update(done)
    finally:
        for s in serves.values():
            orphans += s.stop()
    med = {b: statistics.median(runs[b]) for b in BACKENDS}
    common = sorted(set(texts["elastic"]) & set(texts["none"]))
    print(json.dumps({
        "bench": "overhead", "commit": commit(),
        "tokens_per_s_elastic": round(med["elastic"], 1),
        "tokens_per_s_none": round(med["none"], 1),
        "ratio": round(med["elastic"] / med["none"], 3),
        "spread_elastic": round((max(runs["elastic"]) - min(runs["elastic"])) / med["elastic"], 3),
        "spread_none": round((max(runs["none"]) - min(runs["none"])) / med["none"], 3),
        "runs_elastic": [round(x, 1) for x in runs["elastic"]],
        "runs_none": [round(x, 1) for x in runs["none"]],
        "idle_cpu_s_while_elastic_measured": round(statistics.median(idle_cpu["elastic"]), 2),
        "idle_cpu_s_while_none_measured": round(statistics.median(idle_cpu["none"]), 2),
        "outputs_identical": all(texts["elastic"][i] == texts["none"][i] for i in common),
        "compared_prompts": len(common),
        "repeats": args.repeats, "window_s": args.window_s, "ep_size": args.ep_size,
        "redundant": args.ep_num_redundant_experts, "device": args.device,
        "cuda_graph": cuda_graph_on(args),
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "orphans": orphans, "machine": machine(),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
