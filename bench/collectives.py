"""Benchmark of the elastic backend against raw ProcessGroupGloo (4 ranks, one JSON line).

Measures, in one run:
* latency of all_reduce at 4 B and 1 MiB and all_to_all_single at 1 MiB, ours vs a raw
  ProcessGroupGloo over the same ranks; A and B rounds are interleaved and the medians
  of per-op latencies are reported with their ratio (target <= 1.2);
* kill-to-return: SIGKILL of one rank in an all_reduce loop -> every survivor has a
  result without the victim (target <= 1 s); a result returned after the signal that
  still counts the victim is not failover and is skipped;
* freeze-to-return: SIGSTOP of one rank -> every survivor has a result without it
  (target <= 3 s, bounded by the heartbeat timeout);
* rejoin pause: from the survivors' recover_ranks call to their next all_reduce result.

Run: ``python -m bench.collectives [--rounds 6 --iters 30]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import elasticep.distributed as ed
import elasticep.membership as em
from bench._procs import Procs
from elasticep_testkit.admission import agree_ready

N = 4


def _init(rank, addr, ext=False, ws=N):
    # One intra-op thread per rank: N ranks share the cores, and oversubscribed OpenMP
    # copies would dominate every number here (raw Gloo does no torch copies).
    torch.set_num_threads(1)
    ed.init_process_group(addr, rank, ws, max_world_size=N, is_extension=ext, timeout_s=30)


def latency_worker(rank, addr, conn, rounds, iters):
    _init(rank, addr)
    store = ed.store_client()
    raw = dist.ProcessGroupGloo(dist.PrefixStore("bench/raw/", store), rank, N,
                                timedelta(seconds=30))
    small = torch.ones(1)
    big = torch.ones(256 * 1024)  # 1 MiB fp32
    a2a_in = torch.ones(256 * 1024)
    a2a_out = torch.empty_like(a2a_in)
    cases = {
        "all_reduce_4B": (lambda: raw.allreduce([small]).wait(), lambda: dist.all_reduce(small)),
        "all_reduce_1MiB": (lambda: raw.allreduce([big]).wait(), lambda: dist.all_reduce(big)),
        "all_to_all_single_1MiB": (
            lambda: raw.alltoall_base(a2a_out, a2a_in, [], [], dist.AllToAllOptions()).wait(),
            lambda: dist.all_to_all_single(a2a_out, a2a_in)),
    }
    out = {}
    for name, (raw_fn, ours_fn) in cases.items():
        times = {"raw": [], "ours": []}
        for rnd in range(rounds):
            order = ("raw", "ours") if rnd % 2 == 0 else ("ours", "raw")
            for mode in order:
                fn = raw_fn if mode == "raw" else ours_fn
                raw.allreduce([torch.zeros(1)]).wait()  # line the ranks up
                for _ in range(iters):
                    t0 = time.perf_counter()
                    fn()
                    times[mode].append(time.perf_counter() - t0)
        out[name] = {m: statistics.median(v) for m, v in times.items()}
    conn.send(("lat", out))
    raw.allreduce([torch.zeros(1)]).wait()
    time.sleep(1.0)
    os._exit(0)


def loop_worker(rank, addr, conn, duration_s, watch, ext):
    """Header all_reduce (agree on admitting `watch`), then a data all_reduce."""
    _init(rank, addr, ext)
    if ext:
        ed.join_group(timeout_s=30)
    t_end = time.monotonic() + duration_s
    t_rec = None
    while True:
        agreed = agree_ready(watch, N)
        if agreed:
            t_rec = time.monotonic()
            ed.recover_ranks(None, agreed)
            continue
        t = torch.tensor([1.0, float(time.monotonic() > t_end)])
        dist.all_reduce(t)
        conn.send(("op", time.time(), float(t[0])))
        if t_rec is not None:
            conn.send(("pause", time.monotonic() - t_rec))
            t_rec = None
        if t[1] > 0:
            break
        time.sleep(0.001)
    conn.send(("done",))
    time.sleep(1.0)
    os._exit(0)


def _without_victim(ops: list[tuple[float, float]], t_sig: float) -> list[float]:
    """Times (time.time()) of a rank's ``(time, sum)`` loop results after ``t_sig`` that
    exclude the victim: every rank adds 1.0, so their sum is N - 1."""
    return [t for t, total in ops if t > t_sig and total == N - 1]


def _failure_phase(ctx, sig, victim=2):
    coord = em.start_coordinator(hb_interval_s=0.2, hb_timeout_s=2.0)
    ps = Procs(ctx, coord.address)
    try:
        for r in range(N):
            ps.start(r, loop_worker, 4.0 if sig == signal.SIGKILL else 6.0, [], False)
        ps.poll(lambda: ps.count("op") >= 100)
        t_sig = time.time()
        ps.kill(victim, sig)
        survivors = [r for r in range(N) if r != victim]
        ps.poll(lambda: all(_without_victim(ps.of(r, "op"), t_sig) for r in survivors))
        return max(min(_without_victim(ps.of(r, "op"), t_sig)) for r in survivors) - t_sig
    finally:
        ps.close()
        coord.close()


def _rejoin_phase(ctx):
    coord = em.start_coordinator(hb_interval_s=0.2, hb_timeout_s=2.0)
    ps = Procs(ctx, coord.address)
    try:
        for r in range(N):
            ps.start(r, loop_worker, 5.0, [2], False)
        ps.poll(lambda: ps.count("op") >= 40)
        ps.kill(2)
        ps.reap(2)
        time.sleep(0.5)
        ps.start(2, loop_worker, 60.0, [2], True)
        ps.poll(lambda: all(ps.of(r, "pause") for r in (0, 1, 3)))
        return max(ps.of(r, "pause")[0][0] for r in (0, 1, 3))
    finally:
        ps.close()
        coord.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "elasticep.distributed"])
    coord = em.start_coordinator()
    ps = Procs(ctx, coord.address)
    try:
        for r in range(N):
            ps.start(r, latency_worker, args.rounds, args.iters)
        ps.poll(lambda: len(ps.of(0, "lat")) == 1, timeout=300)
        lat = ps.of(0, "lat")[0][0]
    finally:
        ps.close()
        coord.close()
    result = {"ranks": N, "torch": torch.__version__}
    for name, v in lat.items():
        result[name] = {"raw_us": round(v["raw"] * 1e6, 1), "ours_us": round(v["ours"] * 1e6, 1),
                        "ratio": round(v["ours"] / v["raw"], 3)}
    result["kill_to_return_s"] = round(_failure_phase(ctx, signal.SIGKILL), 4)
    result["freeze_to_return_s"] = round(_failure_phase(ctx, signal.SIGSTOP), 4)
    result["rejoin_pause_s"] = round(_rejoin_phase(ctx), 4)
    print(json.dumps(result))


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
