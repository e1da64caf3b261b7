"""Sweep the FP8 decode expert kernels' tiles and write the device's tile table.

For each expert shape (Qwen3-30B-A3B's ``2048x768`` over 128 slots and DeepSeek-V3's
``7168x2048`` over 256 by default) and each row count of the decode regime (the per-row
kernels of :mod:`elasticep.moe.experts.fp8_rows` at 1, 8, 16 and 64 rows, the sorted
ones of :mod:`elasticep.moe.experts.fp8_sorted` at 128 to 2048 rows; each token's rows on
``top_k`` distinct random slots), every candidate tile of each kernel (gate/up and down
apart: they are separate launches) is

1. checked: the whole expert computation with that tile in its place (the other kernel
   at its default tile) against ``swiglu_rows_fp8_reference``, within the rounding
   bound the GPU tests use (``elasticep_testkit.fp8_expert_check``), on an output
   poisoned with NaN first;
2. timed: launches over different random slot sets captured in one CUDA graph (enough
   of them that the weights they read overflow the L2 cache four times, as the layers
   of a decode step do), the median of 5 replays, per launch;
3. printed as one JSON line with the bytes it must read over a device-to-device copy's
   bandwidth measured in the same run (``bound_us``) and its ``x_bound``.

A config that fails to compile, to launch or the check is printed with ``ok: false``
and counted. The grid is compact: phase 1 times every (block, block_m, warps) at
Triton's default pipelining; phase 2 times ``--stages`` for the ``--refine`` fastest of
phase 1 at each (kernel, shape, rows). Compiling dominates the run: a config compiles once per shape, in about
0.3 s (per-row kernels) or 0.7 s (sorted) for sm_90 on one CPU core, so the defaults
(60 configs a shape in phase 1, at most 3 new ones per (kernel, shape, rows) in phase 2,
at most about 230 compiles) take about 2 minutes of compiling plus about a minute of
data, references and timing on an H100; ``--max-seconds`` stops starting new cases past
a budget. (Compiled for sm_90 with Triton 3.9, no tile of the grid changed its binary
with num_stages 1 to 4: these loops are not software-pipelined. Phase 2 checks whether
the device's Triton does otherwise.)

The best passing tile per (kernel, shape, bucket) is written with ``--write-table`` in
the format :mod:`elasticep.moe.experts.fp8_tiles` reads (merged into the file there:
the other kernels' entries, the W8A8 prefill ones, kept); given the package's
``elasticep/moe/experts/tile_configs`` directory, it lands where the kernels look for it
(``<device slug>.json``). The last line is
a summary. ``--device cpu`` runs the same code under ``TRITON_INTERPRET=1`` (a dry run
for the tests: float32 rows, wall-clock timing, no graphs).

    python -m bench.fp8_decode_sweep --write-table $OUT/table.json > $OUT/sweep.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from bench._commit import commit
from bench._fp8_sweep_cases import Case, down, expert_slots, gate_up, make_case, slot_bytes
from elasticep.moe.experts.fp8_tiles import (
    DEFAULTS,
    ROWS_KERNELS,
    SORTED_KERNELS,
    Entry,
    Tile,
    TileTableError,
    bucket_value,
    check_table_targets,
    device_slug,
    write_merged,
)
from elasticep_testkit.fp8_expert_check import worst_ratio

# phase 1 candidates: the defaults plus a compact grid
GRIDS = {
    "fp8_rows_gate_up": [Tile(b, w) for b in (4, 8, 16, 32) for w in (2, 4, 8)],
    "fp8_rows_down": [Tile(b, w) for b in (16, 32, 64, 128) for w in (2, 4, 8)],
    "fp8_sorted_gate_up": [Tile(b, w, m) for m in (16, 32) for b in (32, 64, 128)
                           for w in (2, 4, 8)],
    "fp8_sorted_down": [Tile(b, w, m) for m in (16, 32) for b in (32, 64, 128)
                        for w in (2, 4, 8)],
}
# the dry run's grid: the default and one other tile per kernel
TINY_GRIDS = {k: [DEFAULTS[k], Tile(DEFAULTS[k].block // 2, 2, DEFAULTS[k].block_m)]
              for k in ROWS_KERNELS + SORTED_KERNELS}


def check(kernel: str, case: Case, experts: tuple, tile: Tile) -> float:
    """The worst ``|out - ref| / bound`` of the expert computation with ``tile`` at
    ``kernel`` and the default tile at the other kernel (outputs poisoned first)."""
    act = torch.full_like(case.act, float("nan"))
    out = torch.full_like(case.rows, float("nan"))
    if kernel.endswith("gate_up"):
        gate_up(case, experts, 0, act, tile)
        down(case, experts, 0, act, out, DEFAULTS[kernel.replace("gate_up", "down")])
    else:
        down(case, experts, 0, case.act, out, tile)
    return worst_ratio(out, case.ref, case.bound)


def time_us(launches: list[Callable[[], None]], dev: torch.device) -> float:
    """Microseconds per launch: on CUDA the launches captured in one graph, the median
    of 5 replays after one; elsewhere one wall-clock pass (the dry run)."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for fn in launches:
            fn()
        return (time.perf_counter() - t0) * 1e6 / len(launches)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(launches))
    return statistics.median(times)


def stage_bytes(kernel: str, case: Case, experts: tuple) -> float:
    """Mean bytes one launch of ``kernel`` must read from HBM over the case's slot sets:
    the touched slots' weights and scales (each expert once)."""
    w, s = (experts[:2] if kernel.endswith("gate_up") else experts[2:])
    touched = sum(int(t.unique().numel()) for t in case.sets) / len(case.sets)
    return touched * slot_bytes(w, s)


def measure(kernel: str, case: Case, experts: tuple, tile: Tile, copy_bw: float,
            dev: torch.device) -> dict:
    """One config's record: the check, then the time (skipped once the check fails);
    a compile or launch error is recorded, not raised."""
    rec = {"block_m": tile.block_m, "block": tile.block, "num_warps": tile.num_warps,
           "num_stages": tile.num_stages}
    try:
        worst = check(kernel, case, experts, tile)
        rec["worst_over_bound"] = round(worst, 4) if worst == worst else None  # NaN: None
        if not worst <= 1:
            return {**rec, "ok": False, "error": "output outside the rounding bound"}
        act, out = case.act.clone(), torch.empty_like(case.rows)
        if kernel.endswith("gate_up"):
            fns = [lambda j=j: gate_up(case, experts, j, act, tile) for j in range(len(case.sets))]
        else:
            fns = [lambda j=j: down(case, experts, j, act, out, tile)
                   for j in range(len(case.sets))]
        us = time_us(fns, dev)
    except Exception as e:  # noqa: BLE001 - a config that fails to build or launch is data
        return {**rec, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    bound_us = stage_bytes(kernel, case, experts) / copy_bw * 1e6
    return {**rec, "ok": True, "us": round(us, 2), "bound_us": round(bound_us, 2),
            "x_bound": round(us / bound_us, 3)}


def copy_bandwidth(dev: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes``, read and write counted
    (:func:`time_us`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        dst.copy_(src)
        return 2 * nbytes / (time.perf_counter() - t0)
    us = time_us([lambda: dst.copy_(src)], dev)
    return 2 * nbytes / (us / 1e6)


def sweep_kernel(kernel: str, case: Case, experts: tuple, grid: list[Tile],
                 stages: list[int], refine: int, copy_bw: float, dev: torch.device,
                 emit: Callable[[dict], None]) -> list[tuple[Tile, dict]]:
    """Phase 1 over ``grid`` (the default tile included), then phase 2: ``stages`` for
    the ``refine`` fastest passing tiles. Emits and returns every record."""
    head = {"bench": "fp8_decode_sweep", "kernel": kernel, "hidden": case.hidden,
            "inter": case.inter, "slots": case.slots, "rows": case.rows.shape[0],
            "bucket": bucket_value(kernel, case.rows.shape[0], case.slots)}
    seen, results = set(), []
    for phase, tiles in ((1, [DEFAULTS[kernel], *grid]), (2, None)):
        if tiles is None:
            passing = sorted((r["us"], i) for i, (_, r) in enumerate(results) if r["ok"])
            tiles = [replace(results[i][0], num_stages=s) for _, i in passing[:refine]
                     for s in stages]
        for tile in tiles:
            if tile in seen:
                continue
            seen.add(tile)
            rec = {**head, "phase": phase, "default": tile == DEFAULTS[kernel],
                   **measure(kernel, case, experts, tile, copy_bw, dev)}
            emit(rec)
            results.append((tile, rec))
    return results


def choose(results: list[tuple[Tile, dict]], min_gain: float) -> tuple[Tile, dict] | None:
    """The tile to ship of one (kernel, shape, rows): among the passing ones within
    ``min_gain`` (a fraction) of the fastest, which timing noise cannot order, the
    default tile if it is one, else the fastest at Triton's default stages, else the
    fastest. None when none passed."""
    ok = [(r["us"], i) for i, (_, r) in enumerate(results) if r["ok"]]
    if not ok:
        return None
    fastest = min(ok)[0]
    near = [results[i] for us, i in sorted(ok) if us <= fastest * (1 + min_gain)]
    for prefer in (lambda t, r: r["default"], lambda t, r: t.num_stages is None):
        picked = [(t, r) for t, r in near if prefer(t, r)]
        if picked:
            return picked[0]
    return near[0]


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"HxI:S"`` -> ``(hidden, inter, slots)``."""
    dims, slots = text.split(":")
    hidden, inter = (int(v) for v in dims.split("x"))
    return hidden, inter, int(slots)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", default=None, metavar="HxI:S",
                   help="hidden x moe_intermediate : slots (repeatable; default "
                        "2048x768:128 and 7168x2048:256)")
    p.add_argument("--rows", default="1,8,16,64", help="row counts of the per-row kernels")
    p.add_argument("--sorted-rows", default="128,256,512,1024,2048",
                   help="row counts of the sorted kernels")
    p.add_argument("--stages", default="1,2,3,4", help="phase 2's num_stages values")
    p.add_argument("--refine", type=int, default=1,
                   help="phase 2 tries --stages on this many fastest phase-1 tiles")
    p.add_argument("--grid", choices=("full", "tiny"), default="full",
                   help="tiny: the default and one other tile per kernel (the dry run)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run under TRITON_INTERPRET=1 (float32 rows)")
    p.add_argument("--write-table", type=Path, action="append", default=[], metavar="PATH",
                   help="write the best passing tile per (kernel, shape, bucket) to this "
                        ".json file, or as <device slug>.json into this directory (made "
                        "if missing; repeatable)")
    p.add_argument("--min-gain", type=float, default=0.03,
                   help="a tile must beat the default (or a staged one its unstaged "
                        "twin) by this fraction to be chosen")
    p.add_argument("--max-seconds", type=float, default=480,
                   help="start no new (shape, rows) case after this long; the table and "
                        "summary still come out, naming the cases skipped")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench.fp8_decode_sweep needs CUDA (or --device cpu)", file=sys.stderr)
        return 2
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
        return 2
    t_start = time.time()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    try:  # before the sweep's minutes: write_merged refuses a bad table only at the end
        check_table_targets(args.write_table, name)
    except (TileTableError, OSError) as e:
        print(f"bench.fp8_decode_sweep: error: --write-table: {e}", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    grids = GRIDS if args.grid == "full" else TINY_GRIDS
    stages = [int(v) for v in args.stages.split(",") if v]
    copy_bw = copy_bandwidth(dev, 1 << 30 if dev.type == "cuda" else 1 << 20)
    tag = {"commit": commit(), "device": name}

    def emit(rec: dict) -> None:
        print(json.dumps({**rec, **tag}), flush=True)

    best: dict[tuple[str, int, int, float], tuple[Tile, dict]] = {}
    failed, skipped, total = [], [], 0
    for hidden, inter, slots in (parse_shape(s) for s in
                                 args.shape or ["2048x768:128", "7168x2048:256"]):
        experts = expert_slots(hidden, inter, slots, dev, seed=hidden)
        emit({"bench": "fp8_decode_sweep_shape", "hidden": hidden, "inter": inter,
              "slots": slots, "copy_bw_GBps": round(copy_bw / 1e9, 1)})
        for family, counts in (("rows", args.rows), ("sorted", args.sorted_rows)):
            for n in (int(v) for v in counts.split(",") if v):
                if time.time() - t_start > args.max_seconds:
                    skipped.append(f"{family} {hidden}x{inter} rows {n}")
                    continue
                print(f"fp8_decode_sweep: {family} {hidden}x{inter} rows {n} at "
                      f"{time.time() - t_start:.0f} s", file=sys.stderr, flush=True)
                case = make_case(family, experts, n, dtype, dev, seed=n)
                for kernel in (f"fp8_{family}_gate_up", f"fp8_{family}_down"):
                    results = sweep_kernel(kernel, case, experts, grids[kernel], stages,
                                           args.refine, copy_bw, dev, emit)
                    total += len(results)
                    failed += [r for _, r in results if not r["ok"]]
                    pick = choose(results, args.min_gain)
                    if pick is not None:
                        tile, rec = pick
                        default_us = next((r["us"] for _, r in results
                                           if r["default"] and r["ok"]), None)
                        best[(kernel, hidden, inter, rec["bucket"])] = (
                            tile, {"rows": n, "slots": slots, "us": rec["us"],
                                   "x_bound": rec["x_bound"], "default_us": default_us})
                del case
        del experts
    entries = [Entry(k, h, i, b, tile) for (k, h, i, b), (tile, _) in best.items()]
    for path in args.write_table:
        write_merged(path, name, entries, f"python -m bench.fp8_decode_sweep at {tag['commit']}",
                     {key: rec for key, (_, rec) in best.items()})
    emit({"bench": "fp8_decode_sweep_summary", "configs": total,
          "passed": total - len(failed), "failed": len(failed),
          "failed_configs": [{k: r[k] for k in ("kernel", "hidden", "rows", "block_m",
                                                 "block", "num_warps", "num_stages", "error")}
                             for r in failed],
          "best": [{"kernel": k, "hidden": h, "inter": i, "bucket": b, "block_m": t.block_m,
                    "block": t.block, "num_warps": t.num_warps, "num_stages": t.num_stages,
                    **rec} for (k, h, i, b), (t, rec) in sorted(best.items())],
          "skipped_cases": skipped, "table_slug": device_slug(name),
          "seconds": round(time.time() - t_start, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
