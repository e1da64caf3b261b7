"""What a stream memory operation costs inside a CUDA graph (issue 26's idle time).

Session 11's profile put about 0.9 ms of a served decode step's GPU idle time near its
96 wait nodes (an estimate from gaps, not a measurement). This bench isolates the cost: one graph
of ``--layers`` x 2 "exchanges", each a tiny kernel that sets a flag (as the send
kernel's own release does for an inactive peer) and then, by variant:

* ``kernels``: nothing else (the floor: kernel after kernel);
* ``batch``: one batched wait(==1) + write(0) node (what the exchange does today);
* ``batch_nobarrier``: the same with the write's memory barrier off;
* ``pair``: a wait node and a separate write node;
* ``wait_only``: a wait node; the next exchange's kernel clears the flag (the reset
  folded into a kernel).

Prints one JSON line: per variant the median replay time in ms, the extra
microseconds per wait against ``kernels``, and the host time of the launch itself.

    python -m bench.graph_node_cost --layers 48
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench._commit import commit

VARIANTS = ("kernels", "batch", "batch_nobarrier", "pair", "wait_only")


def _ops(variant: str, addr: int):
    from elasticep.moe.exchange import stream_memops as sm
    drv = sm.driver()
    if variant == "batch":
        return lambda: sm.wait_and_reset32([addr])
    if variant == "batch_nobarrier":
        w = sm._batch_param("wait", addr, 1)
        r = sm._batch_param("write", addr, 0)
        r.writeValue.flags = drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER
        return lambda: sm._check(drv.cuStreamBatchMemOp(sm._stream(None), 2, [w, r], 0))
    if variant == "pair":
        return lambda: (sm.wait_value32(addr, 1), sm.write_value32(addr, 0))
    if variant == "wait_only":
        return lambda: sm.wait_value32(addr, 1)
    return lambda: None


def _graph(variant: str, n: int) -> torch.cuda.CUDAGraph:
    flags = torch.zeros(n + 1, dtype=torch.int32, device="cuda")
    pattern = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    waits = [_ops(variant, flags[i + 1].data_ptr()) for i in range(n)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
        for i in range(n):
            if variant == "wait_only":  # clear the previous flag, set this one: one kernel
                flags[i:i + 2].copy_(pattern)
            else:
                flags[i + 1].fill_(1)
            waits[i]()
        flags[n].zero_()
    torch.cuda.synchronize()
    g.flags = flags  # the graph reads it at every replay: keep it alive with the graph
    return g


def _launch_us(g: torch.cuda.CUDAGraph) -> float:
    """Host microseconds of one ``replay()`` call (the launch, not the run)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.replay()
    t = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    return t


def main(argv: list[str] | None = None) -> int:
    """Measure every variant; print the JSON line."""
    ap = argparse.ArgumentParser(prog="python -m bench.graph_node_cost",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args(argv)
    from bench.spike_stream_wait import replay_ms
    from elasticep.moe.exchange import stream_memops
    stream_memops.batch_works(torch.cuda.current_device())  # its self-test, before any capture
    n = 2 * args.layers
    out, launch = {}, {}
    errors = {}
    for v in VARIANTS:
        try:
            g = _graph(v, n)
            replay_ms(g, 5)
            out[v] = statistics.median(replay_ms(g, args.replays))
            launch[v] = statistics.median(_launch_us(g) for _ in range(args.replays))
        except Exception as exc:  # noqa: BLE001 - a variant the driver refuses is a result
            errors[v] = repr(exc)[:200]
            torch.cuda.synchronize()
    base = out["kernels"]
    line = {"bench": "graph_node_cost", "commit": commit(), "waits": n,
            "replay_ms": {v: round(t, 4) for v, t in out.items()},
            "extra_us_per_wait": {v: round((t - base) * 1e3 / n, 2) for v, t in out.items()},
            "launch_us": {v: round(t, 1) for v, t in launch.items()}, "errors": errors}
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
