"""A lab model (not product code): the rank's mixed chunked-prefill admission
(elasticep.engine.admission, through its pure plan function) driven by C closed-loop
clients, to see whether the delay between a request's end and its client's next
request reaching the rank makes the rank's waiting queue grow at C = 256.

Step time model from session 21's call 2 records (one H100, Qwen3-30B-A3B shape, bf16):
a decode-only step at 256 running about 36 ms (ITL p50 36.3 ms), a step carrying 8,192
prompt tokens about 157 ms (scheduled_to_committed p50 156.9 ms), linear between.

Usage: python docs/results/cpu-i50s/admission_sim.py [--clients 256] [--delays-ms 0,20,70,140]
Prints one JSON line per delay: TTFT p50/p99 (seconds, from the client's send) and the
rank steps from arrival to first token (p50, p99).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random

from elasticep.engine.admission import StepBudget, plan_step

DECODE_S, PREFILL_8K_S = 0.036, 0.157 - 0.036
MAX_RUNNING = 512  # the served rank's max_running_requests at 131,296 KV tokens


def simulate(clients: int, per_client: int, prompt: int, output: int, delay_s: float,
             jitter: float, seed: int, budget: StepBudget) -> dict:
    rng = random.Random(seed)
    t = 0.0
    arrivals: list[tuple[float, int, int]] = []  # (time at the rank, client, seq)
    sent: dict[tuple[int, int], float] = {}
    for c in range(clients):
        sent[(c, 0)] = 0.0
        heapq.heappush(arrivals, (delay_s * rng.uniform(1 - jitter, 1 + jitter), c, 0))
    waiting: list[tuple[int, int, float, int]] = []  # (client, seq, arrived, prompt left)
    partial: list[list] = []  # [client, seq, arrived, left]
    running: dict[tuple[int, int], int] = {}  # -> tokens still to decode
    ttft, steps_waited, arrived_step = [], [], {}
    step = 0
    while arrivals or waiting or partial or running:
        while arrivals and arrivals[0][0] <= t:
            a, c, s = heapq.heappop(arrivals)
            waiting.append((c, s, a, prompt))
            arrived_step[(c, s)] = step
        if not (waiting or partial or running):
            t = arrivals[0][0]
            continue
        p = plan_step(len(running), [x[3] for x in partial], [x[3] for x in waiting],
                      MAX_RUNNING - len(running) - len(partial), budget)
        tokens = p.prefill
        t += DECODE_S + PREFILL_8K_S * tokens / 8192
        step += 1
        finished = []
        for key in list(running):
            running[key] -= 1
            if running[key] == 0:
                finished.append(key)
                del running[key]
        new_partial = []
        for x, n in zip(partial, p.partial, strict=False):
            x[3] -= n
            (new_partial if x[3] > 0 else finished_prefill(x, running, output, ttft,
                                                            steps_waited, arrived_step,
                                                            sent, t, step)).append(x)
        admitted, waiting = waiting[:len(p.admitted)], waiting[len(p.admitted):]
        for (c, s, a, left), n in zip(admitted, p.admitted, strict=True):
            x = [c, s, a, left - n]
            (new_partial if x[3] > 0 else finished_prefill(x, running, output, ttft,
                                                            steps_waited, arrived_step,
                                                            sent, t, step)).append(x)
        partial = new_partial
        for c, s in finished:
            if s + 1 < per_client:
                sent[(c, s + 1)] = t
                heapq.heappush(arrivals, (t + delay_s * rng.uniform(1 - jitter, 1 + jitter),
                                          c, s + 1))
    ttft.sort()
    steps_waited.sort()
    q = lambda v, f: v[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
    return {"ttft_p50_s": round(q(ttft, 0.5), 3), "ttft_p99_s": round(q(ttft, 0.99), 3),
            "rank_steps_p50": q(steps_waited, 0.5), "rank_steps_p99": q(steps_waited, 0.99),
            "duration_s": round(t, 2)}


def finished_prefill(x, running, output, ttft, steps_waited, arrived_step, sent, t, step):
    c, s = x[0], x[1]
    ttft.append(t - sent[(c, s)])
    steps_waited.append(step - arrived_step[(c, s)])
    if output > 1:
        running[(c, s)] = output - 1
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--per-client", type=int, default=2)
    ap.add_argument("--delays-ms", default="0,20,70,140")
    ap.add_argument("--jitter", type=float, default=0.5, help="delay spread, +- fraction")
    ap.add_argument("--budget", type=int, default=8192)
    args = ap.parse_args()
    budget = StepBudget(args.budget, args.budget)
    for d in (float(x) for x in args.delays_ms.split(",")):
        out = simulate(args.clients, args.per_client, 256, 256, d / 1000, args.jitter, 0,
                       budget)
        print(json.dumps({"clients": args.clients, "delay_ms": d, "jitter": args.jitter,
                          "budget": args.budget, **out}))


if __name__ == "__main__":
    main()
