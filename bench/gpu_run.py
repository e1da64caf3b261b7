"""One lease on a 2-GPU machine: check, benchmark and write every GPU result.

Sections (each runs even if an earlier one failed; its error is recorded instead):

* ``env``: torch / CUDA / NCCL versions, GPUs, ``shrink_group``, and which of the
  serve path's pure-python dependencies import.
* ``nccl``: 2 ranks (one per GPU) on the "elastic" backend: all_reduce (fp32, bf16)
  and all_to_all_single results (even and uneven splits; whether the steady-state
  fast path is taken); the EP2 padded exchange + grouped GEMM over the elastic group
  against a single-rank fp32 reference; latency of all_to_all_single (8, 64 MiB) and
  all_reduce (4 B, 8 MiB), ours against plain NCCL called directly (``raw``) and
  through torch.distributed on a registered NCCL group (``raw_dist``, the same call
  ours takes), interleaved rounds, medians per op with a ``cuda.synchronize`` after
  each (latency) and over back-to-back ops (pipelined); MoE-layer step throughput with
  the exchange of the EP executor (``exchange_over``) over ``elastic`` against the same
  over the registered NCCL group (``none``), and over ``elastic`` through
  torch.distributed's all_to_all_single (``elastic_via_dist``).
* ``kill``: 2 ranks loop a CPU header all_reduce, a GPU all_to_all and all_reduce; rank 1 is
  SIGKILLed; the survivor's interruption, the old communicator's abort time and the
  new one's build time; then rank 1 is relaunched and the survivor's rejoin pause
  (on_failure="complete": every op host-waited). ``kill_in_a2a``: the same under
  on_failure="raise" (stream-ordered all_to_all), rank 1 killing itself right after a
  header so the survivor's all_to_all is in flight without it.
* ``kernels``: grouped GEMM SwiGLU vs fp32 reference, and its time vs the
  sorted-matmul fallback.
* ``generate``: greedy tokens of 8 GSM8K prompts, ``--device cuda`` vs cpu (EP1, EP2).
* ``serve``: ``elasticep serve --device cuda --ep-size 2`` under a streaming load, with
  decode CUDA graphs on and off (``--serve-graphs``): tokens/s of backend elastic
  against none (``bench/overhead.py``), then a kill, a SIGSTOP and a kill + relaunch of
  rank 1 (``bench/failover.py --scenario kill|freeze|rejoin``).

Run: ``NCCL_NVLS_ENABLE=0 python -m bench.gpu_run --out DIR`` (``--cpu`` dry-runs the
multi-process sections on Gloo/CPU to check the script). Writes DIR/gpu_results.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
import torch
import torch.distributed as dist

import elasticep.distributed as ed
import elasticep.membership as em
from bench._procs import Procs, worker
from elasticep.moe.exchange.padded_exchange import (
    exchange_over,
    padded_combine,
    padded_dispatch,
    pair_capacity,
)
from elasticep.moe.experts.expert_compute import grouped_swiglu, run_expert_rows
from elasticep.moe.local_executor import run_slots
from elasticep_testkit.prompts import gsm8k_questions

ROOT = Path(__file__).resolve().parents[1]
DEPS = ("fastapi", "uvicorn", "zmq", "prometheus_client", "openai", "safetensors",
        "tokenizers", "tqdm", "transformers", "httpx")


def _dev(rank: int, cuda: bool) -> torch.device:
    if cuda:
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _raw_group(rank: int, addr: str, cuda: bool, tag: str):
    pre = dist.PrefixStore(f"bench/raw/{tag}/", ed.store_client())
    if cuda:
        return dist.ProcessGroupNCCL(pre, rank, 2)
    return dist.ProcessGroupGloo(pre, rank, 2, timedelta(seconds=60))


# --------------------------------------------------------------------------- nccl
def _moe_problem(dev, dtype, G=2, S=64, H=2048, inter=768, k=8, T=128, seed=0):
    """Random EP problem, identical on every rank (same seed, same device type)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = (torch.randn(G * S, 2 * inter, H, generator=g, device=dev) * 0.02).to(dtype)
    w2 = (torch.randn(G * S, H, inter, generator=g, device=dev) * 0.02).to(dtype)
    hidden = [torch.randn(T, H, generator=g, device=dev).to(dtype) for _ in range(G)]
    slots = [torch.argsort(torch.rand(T, G * S, generator=g, device=dev), dim=1)[:, :k]
             for _ in range(G)]
    weights = [torch.rand(T, k, generator=g, device=dev) for _ in range(G)]
    return dict(w13=w13, w2=w2, hidden=hidden, slots=slots, weights=weights, S=S, k=k, T=T)


def _moe_layer(p, rank, dev, exchange, w13, w2, hidden, slots, weights):
    S, k, T = p["S"], p["k"], p["T"]
    cap = pair_capacity(T, k, S)
    rows, tags, handle = padded_dispatch(hidden, slots, S, 2, cap, exchange)
    return padded_combine(grouped_swiglu(w13, w2, rows, tags), handle, weights, exchange,
                          dtype=torch.float32)


@worker
def nccl_worker(rank, addr, conn, cuda, rounds, iters):
    dev = _dev(rank, cuda)
    # on_failure="raise", like the EP engine's WORLD (stream-ordered all_to_all)
    ed.init_process_group(addr, rank, 2, timeout_s=60, on_failure="raise")
    res = {}
    # correctness through the elastic group
    x = torch.full((1 << 20,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    res["all_reduce_fp32_ok"] = bool((x == 3).all())
    xb = torch.full((4096,), float(rank + 1), device=dev, dtype=torch.bfloat16)
    dist.all_reduce(xb)
    res["all_reduce_bf16_ok"] = bool((xb == 3).all())
    inp = torch.arange(8, device=dev, dtype=torch.float32) + 100 * rank
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.arange(4) + 4 * rank, torch.arange(4) + 4 * rank + 100])
    res["all_to_all_ok"] = bool((out.cpu() == want).all())
    # EP2 padded exchange + grouped GEMM over the elastic group vs fp32 reference
    dtype = torch.bfloat16
    p = _moe_problem(dev, dtype) if cuda else _moe_problem(dev, dtype, S=4, H=64,
                                                               inter=32, k=2, T=8)
    S = p["S"]
    w13 = p["w13"][rank * S:(rank + 1) * S].to(dev)
    w2 = p["w2"][rank * S:(rank + 1) * S].to(dev)
    args = (p["hidden"][rank].to(dev), p["slots"][rank].to(dev), p["weights"][rank].to(dev))
    got = _moe_layer(p, rank, dev, exchange_over(None), w13, w2, *args)
    ref = run_slots(p["w13"].float().to(dev), p["w2"].float().to(dev),
                    p["hidden"][rank].float().to(dev), p["slots"][rank].to(dev),
                    p["weights"][rank].to(dev))
    res["ep2_moe_rel_err_bf16"] = float((got - ref).norm() / ref.norm())
    # uneven splits through the elastic group; the second call takes the fast path
    fast = []
    for _ in range(2):
        inp = torch.arange(4, device=dev, dtype=torch.float32) + 100 * rank
        insz, outsz = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [3, 2])
        out = torch.empty(sum(outsz), device=dev)
        dist.all_to_all_single(out, inp, outsz, insz)
        want = [0., 100., 101.] if rank == 0 else [1., 2., 3., 102., 103.]
        res["all_to_all_uneven_ok"] = out.cpu().tolist() == want
        fast.append(ed.group_diagnostics()["fast_path"])
    res["fast_path_after_first_op"] = fast
    # latency: ours vs raw NCCL, called directly and through torch.distributed
    raw = _raw_group(rank, addr, cuda, "lat")
    try:
        reg = dist.new_group([0, 1], backend="nccl" if cuda else "gloo")
    except Exception as e:  # record why; the direct baseline still runs
        res["registered_group_error"] = repr(e)
        reg = None
    a2a_in = torch.randn(2 << 20, device=dev)  # 8 MiB fp32
    a2a_out = torch.empty_like(a2a_in)
    h_in = torch.randn(16 << 20, device=dev)  # 64 MiB fp32: the fixed overhead's share
    h_out = torch.empty_like(h_in)
    big = torch.randn(2 << 20, device=dev)
    small = torch.ones(1, device=dev)
    opts = dist.AllToAllOptions()
    cases = {
        "all_to_all_single_8MiB": {
            "raw": lambda: raw.alltoall_base(a2a_out, a2a_in, [], [], opts).wait(),
            "raw_dist": lambda: dist.all_to_all_single(a2a_out, a2a_in, group=reg),
            "ours": lambda: dist.all_to_all_single(a2a_out, a2a_in),
            "ours_direct": lambda: ed.all_to_all_single(a2a_out, a2a_in)},
        "all_to_all_single_64MiB": {
            "raw": lambda: raw.alltoall_base(h_out, h_in, [], [], opts).wait(),
            "raw_dist": lambda: dist.all_to_all_single(h_out, h_in, group=reg),
            "ours": lambda: dist.all_to_all_single(h_out, h_in),
            "ours_direct": lambda: ed.all_to_all_single(h_out, h_in)},
        "all_reduce_8MiB": {"raw": lambda: raw.allreduce([big]).wait(),
                            "raw_dist": lambda: dist.all_reduce(big, group=reg),
                            "ours": lambda: dist.all_reduce(big)},
        "all_reduce_4B": {"raw": lambda: raw.allreduce([small]).wait(),
                          "raw_dist": lambda: dist.all_reduce(small, group=reg),
                          "ours": lambda: dist.all_reduce(small)},
    }
    cap = pair_capacity(p["T"], p["k"], p["S"])  # the MoE exchange's own sizes
    m_in = torch.randn(2 * cap, 2048, device=dev).to(torch.bfloat16)
    m_out = torch.empty_like(m_in)
    cases["all_to_all_single_moe_rows"] = {
        "raw": lambda: raw.alltoall_base(m_out, m_in, [], [], opts).wait(),
        "raw_dist": lambda: dist.all_to_all_single(m_out, m_in, group=reg),
        "ours": lambda: dist.all_to_all_single(m_out, m_in),
        "ours_direct": lambda: ed.all_to_all_single(m_out, m_in)}
    line = torch.zeros(1, device=dev)
    lat = {}
    for name, fns in cases.items():
        if reg is None:
            fns.pop("raw_dist")
        row = {}
        for pipelined in (False, True):
            med = _interleaved_medians(fns, cuda, rounds, iters, line, raw, pipelined)
            tag = "pipelined_" if pipelined else ""
            for mode, v in med.items():
                row[f"{tag}{mode}_us"] = round(v * 1e6, 1)
            for ours in ("ours", "ours_direct"):
                for base in ("raw", "raw_dist"):
                    if ours in med and base in med:
                        row[f"{tag}{ours}_over_{base}"] = round(med[ours] / med[base], 3)
        lat[name] = row
    res["latency"] = lat
    # MoE-layer steps (4 layers, T tokens per rank): the same code, exchanging over
    # the elastic WORLD or over a plain NCCL group (the `none` baseline)
    base_ex = exchange_over(reg) if reg is not None else _raw_exchange(raw)

    def steps(ex):
        for _layer in range(4):
            _moe_layer(p, rank, dev, ex, w13, w2, *args)

    def via_dist(out, inp):
        dist.all_to_all_single(out, inp)

    before = ed.group_diagnostics()["counters"]
    med = _interleaved_medians({"none": lambda: steps(base_ex),
                                "elastic": lambda: steps(exchange_over(None)),
                                "elastic_via_dist": lambda: steps(via_dist),
                                "none_direct": lambda: steps(_raw_exchange(raw))},
                               cuda, rounds, iters, line, raw, pipelined=True)
    n, e = med["none"], med["elastic"]
    res["moe_step"] = {"tokens_per_rank": p["T"], "layers": 4,
                       "none_group": "registered NCCL" if reg is not None else "raw NCCL",
                       "none_ms": round(n * 1e3, 3), "elastic_ms": round(e * 1e3, 3),
                       "tokens_per_s_none": round(2 * p["T"] / n, 1),
                       "tokens_per_s_elastic": round(2 * p["T"] / e, 1),
                       "elastic_over_none": round(n / e, 4),
                       "elastic_via_dist_ms": round(med["elastic_via_dist"] * 1e3, 3),
                       "elastic_via_dist_over_none": round(n / med["elastic_via_dist"], 4),
                       "none_direct_ms": round(med["none_direct"] * 1e3, 3),
                       "elastic_op_routes": {k: v - before[k] for k, v in
                                             ed.group_diagnostics()["counters"].items()}}
    res["nccl_timings"] = {str(k): v for k, v in ed.group_diagnostics()["nccl_timings"].items()}
    conn.send(("res", res))
    raw.allreduce([line]).wait()
    _sync(cuda)


def _raw_exchange(raw):
    opts = dist.AllToAllOptions()

    def run(out, inp):
        raw.alltoall_base(out, inp, [], [], opts).wait()

    return run


# --------------------------------------------------------------------------- diag
def _interleaved_medians(fns, cuda, rounds, iters, line, raw, pipelined=False):
    """Median seconds per call of each of `fns`, over `rounds` rounds whose order of
    modes alternates. Per-op (default): every call is followed by a device sync, so a
    host overhead adds in full. Pipelined: `iters` calls, then one sync (throughput)."""
    for fn in fns.values():  # warm-up (lazy communicators, caches)
        fn(), fn()
    times = {m: [] for m in fns}
    order = list(fns)
    for rnd in range(rounds):
        for mode in (order if rnd % 2 == 0 else order[::-1]):
            times[mode].extend(_time_calls(fns[mode], cuda, iters, line, raw, pipelined))
    return {m: statistics.median(v) for m, v in times.items()}


def _time_calls(fn, cuda, iters, line, raw, pipelined=False):
    raw.allreduce([line]).wait()  # line the ranks up
    _sync(cuda)
    if pipelined:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(cuda)
        return [(time.perf_counter() - t0) / iters]
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(cuda)
        ts.append(time.perf_counter() - t0)
    return ts


def _median_us(fn, cuda, iters, line, raw):
    return round(statistics.median(_time_calls(fn, cuda, iters, line, raw)) * 1e6, 1)


@worker
def diag_worker(rank, addr, conn, cuda, rounds, iters):
    """Where the per-op overhead goes: waiting variants on raw NCCL, ours per mode."""
    import cProfile
    import io
    import pstats

    from elasticep.distributed import nccl_inner
    dev = _dev(rank, cuda)
    ed.init_process_group(addr, rank, 2, timeout_s=60, on_failure="raise")
    raw = _raw_group(rank, addr, cuda, "diag")
    a_in = torch.randn(2 << 20, device=dev)
    a_out = torch.empty_like(a_in)
    big = torch.randn(2 << 20, device=dev)
    line = torch.zeros(1, device=dev)
    opts = dist.AllToAllOptions()

    def spin(work, yld):
        while not work.is_completed():
            if yld:
                time.sleep(0)
        work.wait()

    def mode(async_, yld):
        nccl_inner.ASYNC_UNFETCHABLE, nccl_inner.YIELD = async_, yld

    variants = {
        "raw_a2a_wait": lambda: raw.alltoall_base(a_out, a_in, [], [], opts).wait(),
        "raw_a2a_spin": lambda: spin(raw.alltoall_base(a_out, a_in, [], [], opts), False),
        "raw_a2a_spin_yield": lambda: spin(raw.alltoall_base(a_out, a_in, [], [], opts),
                                           True),
        "ours_a2a_async": lambda: (mode(True, True), dist.all_to_all_single(a_out, a_in)),
        "ours_a2a_hostwait_yield": lambda: (mode(False, True),
                                            dist.all_to_all_single(a_out, a_in)),
        "ours_a2a_hostwait_spin": lambda: (mode(False, False),
                                           dist.all_to_all_single(a_out, a_in)),
        "raw_ar8M_wait": lambda: raw.allreduce([big]).wait(),
        "ours_ar8M_yield": lambda: (mode(True, True), dist.all_reduce(big)),
        "ours_ar8M_spin": lambda: (mode(True, False), dist.all_reduce(big)),
    }
    res = {k: [] for k in variants}
    for fn in variants.values():
        fn()
    for _ in range(rounds):
        for k, fn in variants.items():
            res[k].append(_median_us(fn, cuda, iters, line, raw))
    out = {k: statistics.median(v) for k, v in res.items()}
    mode(True, True)
    pr = cProfile.Profile()
    raw.allreduce([line]).wait()
    pr.enable()
    for _ in range(300):
        dist.all_reduce(big)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(12)
    out["profile_all_reduce_8MiB_x300"] = buf.getvalue()[-2500:]
    conn.send(("res", out))
    raw.allreduce([line]).wait()
    _sync(cuda)


def _two_ranks(ctx, target, *args, timeout_s=300):
    """Run `target` on ranks 0 and 1 of a fresh coordinator; each rank's "res" message."""
    coord = em.start_coordinator()
    ps = Procs(ctx, coord.address)
    try:
        for r in range(2):
            ps.start(r, target, *args)
        ps.poll(lambda: all(ps.got(r, "res") for r in range(2)), timeout_s)
        return {f"rank{r}": ps.got(r, "res")[0] for r in range(2)}
    finally:
        ps.close()
        coord.close()


def section_diag(ctx, cuda, quick):
    return _two_ranks(ctx, diag_worker, cuda, *((3, 10) if quick else (6, 40)))


# --------------------------------------------------------------------------- kill
@worker
def kill_worker(rank, addr, conn, cuda, ext, stop_file, die_at=None, on_failure="complete"):
    """CPU header all_reduce (agree on admitting ready slots), then a GPU all_to_all and
    a GPU all_reduce. die_at=n: SIGKILL itself right after the n-th header, so the
    survivor is caught with its (stream-ordered) all_to_all in flight."""
    dev = _dev(rank, cuda)
    ed.init_process_group(addr, rank, 2, timeout_s=60, on_failure=on_failure,
                          is_extension=ext)
    if ext:
        ed.join_group(timeout_s=60)
    data = torch.ones(256 * 1024, device=dev)  # 1 MiB
    a2a_out = torch.empty_like(data)
    times, sums, pause, t_rec, n, raised = [], [], None, None, 0, 0
    while True:
        st = ed.get_slot_states()
        h = torch.tensor([1.0 if st[s] == "ready" else 0.0 for s in range(2)]
                         + [float(os.path.exists(stop_file))])
        dist.all_reduce(h, op=dist.ReduceOp.MAX)
        if h[2] > 0:
            break
        if die_at is not None and n == die_at:
            conn.send(("dying", time.time()))
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        agreed = [s for s in range(2) if h[s] > 0]
        if agreed:
            t_rec = time.monotonic()
            ed.recover_ranks(None, agreed)
            continue
        x = data.clone()
        try:  # a stream-ordered all_to_all (the EP dispatch), then a host-waited sum
            dist.all_to_all_single(a2a_out, x)
            dist.all_reduce(x)
        except ed.RankFailureError:  # the a2a cannot be redone: the "step" is redone
            raised += 1
            continue
        times.append(time.time())
        sums.append(x[0].item())  # 1.0 once the survivor runs without the victim
        if t_rec is not None:
            pause, t_rec = time.monotonic() - t_rec, None
        n += 1
        if n == 200:
            conn.send(("started", None))
    diag = ed.group_diagnostics()
    conn.send(("res", {"times": times, "sums": sums, "rejoin_pause_s": pause, "raised": raised,
                       "nccl_timings": diag["nccl_timings"], "epoch": diag["epoch"]}))


def section_nccl(ctx, cuda, quick):
    return _two_ranks(ctx, nccl_worker, cuda, *((2, 5) if quick else (8, 50)))


def section_kill(ctx, cuda, quick, in_a2a=False):
    coord = em.start_coordinator(hb_interval_s=0.2, hb_timeout_s=2.0)
    ps = Procs(ctx, coord.address)
    stop = f"/tmp/gpu_run_stop_{os.getpid()}"
    if os.path.exists(stop):
        os.unlink(stop)
    try:
        for r in range(2):
            ps.start(r, kill_worker, cuda, False, stop, 300 if in_a2a and r == 1 else None,
                     "raise" if in_a2a else "complete")
        ps.poll(lambda: ps.got(0, "started") and ps.got(1, "started"), 120)
        if in_a2a:
            ps.poll(lambda: ps.got(1, "dying"), 120)
            t_kill = ps.got(1, "dying")[0] + 0.05
        else:
            time.sleep(1.0)
            t_kill = time.time()
            ps.kill(1)
        ps.reap(1)
        time.sleep(3.0)  # survivor alone
        t_relaunch = time.time()
        ps.start(1, kill_worker, cuda, True, stop, None, "raise" if in_a2a else "complete")
        ps.poll(lambda: len(ps.got(1, "started")) >= 2, 120)  # the relaunched one
        time.sleep(1.0)
        Path(stop).touch()
        ps.poll(lambda: ps.got(0, "res") and ps.got(1, "res"), 60)
        s = ps.got(0, "res")[0]
        times = s["times"]
        after = [t for t in times if t > t_kill]
        before = [t for t in times if t <= t_kill]
        alone = [t for t in after if t < t_relaunch]
        # a result returned after the kill that still counts rank 1 is not failover
        solo = [t for t, v in zip(times, s["sums"], strict=True) if t > t_kill and v == 1.0]
        out = {
            "interruption_s": round(solo[0] - t_kill, 4) if solo else None,
            # from the last result before the kill to the first without the victim
            "gap_around_kill_s": round(solo[0] - before[-1], 4) if solo and before else None,
            "survivor_ops_alone": len(alone),
            "survivor_steps_raised": s["raised"],
            "rejoin_pause_s": s["rejoin_pause_s"],
            "final_epoch": s["epoch"],
            "survivor_nccl_timings": s["nccl_timings"],
            "joiner_nccl_timings": ps.got(1, "res")[0]["nccl_timings"],
        }
        timings = s["nccl_timings"]
        epochs = sorted(timings)
        if len(epochs) >= 2:
            out["nccl_teardown_s"] = timings[epochs[0]]["abort_s"]
            out["nccl_rebuild_s"] = timings[epochs[1]]["built_s"]
        return out
    finally:
        if os.path.exists(stop):
            os.unlink(stop)
        ps.close()
        coord.close()


# --------------------------------------------------------------------------- single process
def section_env():
    out = {"torch": torch.__version__, "python": sys.version.split()[0],
           "cuda_available": torch.cuda.is_available(),
           "gpus": torch.cuda.device_count(),
           "shrink_group": hasattr(dist, "shrink_group"),
           "grouped_mm": hasattr(torch, "_grouped_mm"),
           "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
    if torch.cuda.is_available():
        out["gpu_name"] = torch.cuda.get_device_name(0)
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    deps = {}
    for m in DEPS:
        try:
            mod = importlib.import_module(m)
            deps[m] = getattr(mod, "__version__", "ok")
        except Exception as e:
            deps[m] = f"MISSING: {type(e).__name__}: {e}"
    out["deps"] = deps
    return out


def _time_cuda(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def section_kernels():
    dev = torch.device("cuda", 0)
    out = {}
    for T in (16, 128, 1024):
        g = torch.Generator().manual_seed(T)
        S, H, inter, k = 64, 2048, 768, 8
        w13 = (torch.randn(S, 2 * inter, H, generator=g) * 0.02).to(dev, torch.bfloat16)
        w2 = (torch.randn(S, H, inter, generator=g) * 0.02).to(dev, torch.bfloat16)
        n = T * k
        rows = torch.randn(n, H, generator=g).to(dev, torch.bfloat16)
        tags = torch.randint(0, S + 1, (n,), generator=g).to(dev, torch.int32)  # 0 = padding
        y = grouped_swiglu(w13, w2, rows, tags, use_grouped=True)
        valid = tags > 0
        ref = torch.zeros(n, H, device=dev)
        ref[valid] = run_expert_rows(w13.float(), w2.float(), rows[valid].float(),
                                     tags[valid].long() - 1)
        err = float((y.float() - ref).norm() / ref.norm())
        pad_zero = bool((y[~valid] == 0).all())
        case = (w13, w2, rows, tags)
        t_g = _time_cuda(lambda c=case: grouped_swiglu(*c, use_grouped=True), 20)
        t_f = _time_cuda(lambda c=case: grouped_swiglu(*c, use_grouped=False), 10)
        flops = 2 * int(valid.sum()) * H * 3 * inter
        out[f"rows_{n}"] = {"rel_err_vs_fp32": round(err, 5), "padding_rows_zero": pad_zero,
                            "grouped_ms": round(t_g, 4), "sorted_matmul_fallback_ms": round(t_f, 4),
                            "grouped_tflops": round(flops / t_g / 1e9, 1)}
    return out


def section_generate(tmp: Path, quick: bool):
    pf = tmp / "prompts8.jsonl"
    pf.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in gsm8k_questions(8)))
    ntok = 8 if quick else 32
    runs = {"cpu_ep1": (["--device", "cpu"], 150), "cuda_ep1": (["--device", "cuda"], 150),
            "cuda_ep1_bf16": (["--device", "cuda", "--dtype", "bfloat16"], 150),
            "cpu_ep2": (["--device", "cpu", "--ep-size", "2"], 150),
            "cuda_ep2": (["--device", "cuda", "--ep-size", "2"], 90),
            "cuda_ep2_bf16": (["--device", "cuda", "--ep-size", "2", "--dtype", "bfloat16"], 90)}
    if os.environ.get("GPU_RUN_SKIP"):
        for name in os.environ["GPU_RUN_SKIP"].split(","):
            runs.pop(name, None)
    toks, out = {}, {}
    for name, (extra, limit) in runs.items():
        cmd = [sys.executable, "-m", "elasticep.entrypoints.cli", "generate", "--prompts-file", str(pf),
               "--max-tokens", str(ntok), *extra]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT)
            wall = round(time.monotonic() - t0, 2)
            if p.returncode == 0:
                toks[name] = [json.loads(s)["token_ids"] for s in p.stdout.splitlines() if s]
                out[name] = {"ok": True, "wall_s": wall}
            else:
                out[name] = {"ok": False, "rc": p.returncode, "stderr_tail": p.stderr[-1500:]}
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr)
            first = err.find("Traceback")
            out[name] = {"ok": False, "timeout": True, "stderr_tail": err[-1200:],
                         "first_traceback": err[first:first + 2500] if first >= 0 else None}
    ref = toks.get("cpu_ep1")
    for name, t in toks.items():
        if ref is None or name == "cpu_ep1":
            continue
        agree = []
        for a, b in zip(ref, t, strict=False):
            same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                        min(len(a), len(b)))
            agree.append(same)
        out[name]["identical_prefix_vs_cpu_ep1"] = agree
    return out


def _bench_json(script: str, args: list[str], limit_s: float) -> dict:
    """Run ``python -m bench.<script> args`` from the repository root and return its
    last JSON line (or why there is none)."""
    cmd = [sys.executable, "-m", f"bench.{script.removesuffix('.py')}", *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr)
        return {"ok": False, "timeout_s": limit_s, "stderr_tail": err[-2000:]}
    lines = [s for s in p.stdout.splitlines() if s.startswith("{")]
    out = {"ok": p.returncode == 0 and bool(lines), "rc": p.returncode,
           "wall_s": round(time.monotonic() - t0, 1), "cmd": " ".join(cmd[1:])}
    if lines:
        out["result"] = json.loads(lines[-1])
    if not out["ok"]:
        out["stderr_tail"] = p.stderr[-2500:]
    return out


def section_serve(out_dir: Path, quick: bool, graphs: list[str], scenarios: list[str],
                  cuda: bool = True):
    """`elasticep serve --device cuda --ep-size 2` under a steady streaming load, once per
    decode CUDA graph mode (``on``, ``off``: ``--disable-cuda-graph``): tokens/s of the
    elastic backend against none (bench/overhead.py, both backends in the same mode),
    then each failover scenario on rank 1 (bench/failover.py: ``kill``, ``freeze``
    (SIGSTOP), ``rejoin`` (kill, then relaunch)). ``cuda=False`` (``--cpu``) runs the
    same plumbing on the CPU, where both modes are eager."""
    common = ["--device", "cuda" if cuda else "cpu", "--ep-size", "2", "--concurrency", "32"]
    ab = ["--repeats", "2" if quick else "4", "--window-s", "4" if quick else "8"]
    windows = (["--healthy-s", "5", "--degraded-s", "5", "--after-s", "6"] if quick else [])
    out: dict = {}
    partial = out_dir / "gpu_serve_partial.json"  # a run cut short keeps what finished
    for mode in graphs:
        flag = [] if mode == "on" else ["--disable-cuda-graph"]
        res = out[f"cuda_graph_{mode}"] = {}
        for name in ["overhead", *scenarios]:
            if name == "overhead":
                res[name] = _bench_json("overhead.py", [*common, *ab, *flag], 300)
            else:  # the ranks' logs stay: their throughput lines show each rank's steps
                logs = out_dir / "logs" / f"{name}_graphs_{mode}"
                res[name] = _bench_json("failover.py", [
                    *common, *flag, *windows, "--scenario", name, "--victim", "1",
                    "--log-dir", str(logs), "--serve-arg=--log-stats-interval=2",
                    "--plot", str(out_dir / f"gpu_{name}_graphs_{mode}.png")], 240)
            partial.write_text(json.dumps(out, indent=1, default=str))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_run"))
    ap.add_argument("--cpu", action="store_true",
                    help="dry run of nccl/kill on Gloo, and of serve on the CPU")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="env,nccl,kill,kill_in_a2a,kernels,generate,serve",
                    help="comma-separated sections (also: diag, where the per-op time goes)")
    ap.add_argument("--serve-graphs", default="on,off",
                    help="serve: decode CUDA graph modes to run, of on,off")
    ap.add_argument("--serve-scenarios", default="kill,freeze,rejoin",
                    help="serve: failover scenarios to run in each mode")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = not args.cpu
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "elasticep.distributed"])
    results: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    sections = {"env": section_env, "nccl": lambda: section_nccl(ctx, cuda, args.quick),
                "diag": lambda: section_diag(ctx, cuda, args.quick),
                "kill": lambda: section_kill(ctx, cuda, args.quick),
                "kill_in_a2a": lambda: section_kill(ctx, cuda, args.quick, in_a2a=True),
                "kernels": section_kernels,
                "generate": lambda: section_generate(out_dir, args.quick),
                "serve": lambda: section_serve(out_dir, args.quick, args.serve_graphs.split(","),
                                               args.serve_scenarios.split(","), cuda)}
    for name in args.only.split(","):
        t0 = time.monotonic()
        try:
            results[name] = sections[name]()
        except BaseException as e:
            results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        results.setdefault("section_s", {})[name] = round(time.monotonic() - t0, 1)
        (out_dir / "gpu_results.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"== {name} ({results['section_s'][name]} s)", flush=True)
        print(json.dumps(results[name], default=str)[:3000], flush=True)


if __name__ == "__main__":
    main()
