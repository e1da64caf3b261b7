"""FP8 experts at prefill sizes: the W8A8 kernels against today's FP8 path, bf16, and the
FP8 matmul bound, one run.

For an expert shape (Qwen3-30B-A3B's: H 2048, I 768, 128 experts, top 8; and
DeepSeek-V3's: 7168, 2048, 256, top 8, all experts on one GPU) and T tokens each routed
to its top-k of uniformly random scores (an 8192-token prefill step sends 65,536 pairs
through each MoE layer), it times on the same experts:

- ``w8a8``: :func:`elasticep.moe.experts.fp8_tiled.swiglu_tiled_fp8` (the token rows
  quantized per 128 columns, then two grouped GEMMs on FP8 tensor cores), whole;
- ``fp8_sorted``: :func:`elasticep.moe.experts.fp8_sorted.swiglu_sorted_fp8` (FP8
  weights widened to bf16 for bf16 tensor cores), the prefill path before the W8A8 one,
  on rows already expanded to one per pair (the expansion, which ``grouped_swiglu`` adds
  on that path, is not timed);
- ``bf16_tiled``: :func:`elasticep.moe.experts.tiled_experts.swiglu_tiled` on the bf16
  weights the FP8 ones were quantized from;
- ``quantize``: the token rows' quantizer alone (part of ``w8a8``).

The bound is the SwiGLU FLOPs (``2 x pairs x 3 x H x I``) over the FP8 dense rate
measured in the same run (:func:`bench.prefill.fp8_matmul_rate`, an ``8192^3``
``torch._scaled_mm``); ``w8a8_x_bound`` is the W8A8 time over it (the issue's target is
at most 1.5). Each record also gives the W8A8 output's relative error (norm) against its
torch reference and against the FP8 path with bf16 activations. ``w8a8_ms`` runs the
tiles the package's table gives this device (the first guesses where it has none);
``w8a8_default_ms`` the first guesses.

``--sweep`` tunes the W8A8 tiles, as ``bench.fp8_decode_sweep`` does the decode
kernels': at each (shape, tokens) every gate/up tile of :data:`GRID_GATE_UP` (the down
kernel at its first guess) and every down tile of :data:`GRID_DOWN` (the gate/up kernel
at its first guess) is checked, the whole output against the W8A8 reference within the
GPU test's derived bound (``elasticep_testkit.fp8_w8a8_bounds``, the tensor cores'
K-step sum allowed ``ACCUMULATION_ERROR``), and its own kernel timed (one JSON line a
tile, ``ok: false`` with the error where it fails to compile, launch or the check). The
fastest passing tile of each kernel (within ``--min-gain`` of it the first guess, as the
decode sweep chooses) is that bucket's (pairs a slot) entry; ``--write-table`` merges
them into the device's table (a ``.json`` path, or a directory for ``<device
slug>.json``; the file's other kernels' entries kept), which the kernels read from
``elasticep/moe/experts/tile_configs`` (:mod:`elasticep.moe.experts.fp8_tiles`).
The record then also times the chosen tiles (``w8a8_swept_ms``).

Prints one JSON line per (shape, tokens), and with ``--sweep`` one a tile and a summary.
GPU only.

    python -m bench.fp8_expert_prefill [--tokens 2048,8192] [--shape qwen3-30b-a3b]
        [--sweep --write-table elasticep/moe/experts/tile_configs]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench._commit import commit
from bench.fp8_decode_sweep import choose
from bench.gpu_run import _time_cuda as cuda_ms  # one CUDA-event median timer
from bench.prefill import fp8_matmul_rate
from elasticep.models.fp8_prefill import ACCUMULATION_ERROR
from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_activations import quantize_activations
from elasticep.moe.experts.fp8_sorted import swiglu_sorted_fp8
from elasticep.moe.experts.fp8_tiled import (
    down_tile_of,
    gate_up_tile_of,
    swiglu_tiled_fp8,
    swiglu_w8a8_reference,
    w8a8_down,
    w8a8_gate_up,
)
from elasticep.moe.experts.fp8_tiles import (
    DEFAULTS,
    W8A8_GATE_UP_BLOCK,
    Entry,
    Tile,
    TileTableError,
    check_table_targets,
    device_slug,
    write_merged,
)
from elasticep.moe.experts.tiled_experts import swiglu_tiled
from elasticep_testkit.fp8_w8a8_bounds import expert_bounds

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8)}
# --sweep's candidates (the first guesses are among them)
GRID_GATE_UP = [Tile(W8A8_GATE_UP_BLOCK, w, m, st) for m in (32, 64, 128) for w in (4, 8)
                for st in (3, 4)]
GRID_DOWN = [Tile(n, w, m, st) for m in (64, 128) for n in (64, 128, 256) for w in (4, 8)
             for st in (3, 4)]
REPS = 10
DEVICE = "cuda"


def _experts(hidden: int, inter: int, slots: int, gen: torch.Generator):
    """bf16 experts and their block-FP8 quantization, drawn 16 slots at a time."""
    parts = []
    for s0 in range(0, slots, 16):
        n = min(16, slots - s0)
        w13 = (torch.randn(n, 2 * inter, hidden, device=DEVICE, generator=gen)
               / hidden ** 0.5).bfloat16()
        w2 = (torch.randn(n, hidden, inter, device=DEVICE, generator=gen) / inter ** 0.5).bfloat16()
        parts.append((w13, *fp8_block.quantize(w13), w2, *fp8_block.quantize(w2)))
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _case(tokens: int, hidden: int, slots: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` random bf16 rows and their pairs' tags, each token on ``k`` distinct
    uniformly random slots (seeded by ``tokens``)."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    rows = torch.randn(tokens, hidden, device=DEVICE, generator=gen).bfloat16()
    tags = (torch.rand(tokens, slots, device=DEVICE, generator=gen).topk(k, dim=1).indices
            .flatten() + 1)
    return rows, tags


def measure(name: str, weights: tuple, tokens: int, rate: float,
            swept: tuple[Tile, Tile] | None) -> dict:
    """One JSON record: the three paths at ``tokens`` tokens of the ``name`` shape, on
    ``weights`` (:func:`_experts`); ``swept``: the sweep's (gate/up, down) tiles, timed
    as well."""
    hidden, inter, slots, k = SHAPES[name]
    w13, q13, s13, w2, q2, s2 = weights
    rows, tags = _case(tokens, hidden, slots, k)
    pairs = rows.repeat_interleave(k, 0)
    fp8 = (q13, s13, q2, s2)
    got = swiglu_tiled_fp8(*fp8, rows, tags, row_repeat=k)
    ref = swiglu_w8a8_reference(*fp8, rows, tags, row_repeat=k)
    sorted_out = swiglu_sorted_fp8(*fp8, pairs, tags)
    times = {
        "w8a8_ms": cuda_ms(lambda: swiglu_tiled_fp8(*fp8, rows, tags, row_repeat=k), REPS),
        "fp8_sorted_ms": cuda_ms(lambda: swiglu_sorted_fp8(*fp8, pairs, tags), REPS),
        "bf16_tiled_ms": cuda_ms(lambda: swiglu_tiled(w13, w2, rows, tags, row_repeat=k), REPS),
        "quantize_ms": cuda_ms(lambda: quantize_activations(rows), REPS),
    }
    first = (gate_up_tile_of(DEFAULTS["w8a8_gate_up"]), down_tile_of(DEFAULTS["w8a8_down"]))
    times["w8a8_default_ms"] = cuda_ms(
        lambda: swiglu_tiled_fp8(*fp8, rows, tags, row_repeat=k, gate_up_tile=first[0],
                                 down_tile=first[1]), REPS)
    if swept is not None:
        tiles = (gate_up_tile_of(swept[0]), down_tile_of(swept[1]))
        times["w8a8_swept_ms"] = cuda_ms(
            lambda: swiglu_tiled_fp8(*fp8, rows, tags, row_repeat=k, gate_up_tile=tiles[0],
                                     down_tile=tiles[1]), REPS)
    flops = 2.0 * tokens * k * 3 * hidden * inter
    bound_ms = flops / rate * 1e3
    return {
        "bench": "fp8_expert_prefill", "commit": commit(), "device": torch.cuda.get_device_name(),
        "shape": name, "hidden": hidden, "moe_intermediate": inter, "slots": slots,
        "top_k": k, "tokens": tokens, "pairs": tokens * k,
        "fp8_matmul_tflops": round(rate / 1e12, 1), "fp8_bound_ms": round(bound_ms, 3),
        **{key: round(v, 3) if isinstance(v, float) else v for key, v in times.items()},
        "w8a8_x_bound": round(times["w8a8_ms"] / bound_ms, 2),
        "fp8_sorted_x_bound": round(times["fp8_sorted_ms"] / bound_ms, 2),
        "bf16_tiled_x_bound": round(times["bf16_tiled_ms"] / bound_ms, 2),
        "w8a8_tflops": round(flops / times["w8a8_ms"] / 1e9, 1),
        "w8a8_rel_err_vs_reference": _rel(got, ref),
        "w8a8_rel_err_vs_fp8_sorted": _rel(got, sorted_out),
    }


def _check_and_time(kernel: str, tile: Tile, case: dict) -> dict:
    """One tile of ``kernel`` (the other kernel at its first guess): the whole output
    against the reference within its bound, then this kernel alone timed (us)."""
    gu = gate_up_tile_of(tile if kernel == "w8a8_gate_up" else DEFAULTS["w8a8_gate_up"])
    dn = down_tile_of(tile if kernel == "w8a8_down" else DEFAULTS["w8a8_down"])
    fp8, rows, tags, k, out = case["fp8"], case["rows"], case["tags"], case["k"], case["out"]
    out.fill_(float("nan"))
    got = swiglu_tiled_fp8(*fp8, rows, tags, out=out, row_repeat=k, gate_up_tile=gu,
                           down_tile=dn)
    diff = (got.float() - case["ref"]).abs()
    worst = float("nan") if bool(torch.isnan(diff).any()) else float(
        (diff / case["bound"]).max())
    if kernel == "w8a8_gate_up":
        def launch():
            w8a8_gate_up(fp8[0], fp8[1], rows, tags, k, gu)
    else:
        def launch():
            w8a8_down(case["act"], fp8[2], fp8[3], out, dn)
    return {"ok": worst <= 1, "worst_over_bound": round(worst, 4),
            "us": round(cuda_ms(launch, REPS) * 1e3, 2)}


def sweep(name: str, weights: tuple, tokens: int, min_gain: float, emit
          ) -> tuple[dict[str, tuple[Tile, dict]], int, int]:
    """--sweep at one (shape, tokens): every tile of :data:`GRID_GATE_UP` and
    :data:`GRID_DOWN` checked and timed (a record each, through ``emit``). Returns
    (the chosen (tile, record) per kernel, configs, configs that failed)."""
    hidden, inter, slots, k = SHAPES[name]
    _, q13, s13, _, q2, s2 = weights
    rows, tags = _case(tokens, hidden, slots, k)
    fp8 = (q13, s13, q2, s2)
    case = {"fp8": fp8, "rows": rows, "tags": tags, "k": k,
            "out": rows.new_empty(tags.shape[0], hidden),
            "ref": swiglu_w8a8_reference(*fp8, rows, tags, row_repeat=k).float(),
            "bound": expert_bounds(*fp8, rows, tags, k, x_rounded=False,
                                   acc=ACCUMULATION_ERROR, sides=2)["out"],
            "act": w8a8_gate_up(q13, s13, rows, tags, k,
                                gate_up_tile_of(DEFAULTS["w8a8_gate_up"]))}
    head = {"bench": "fp8_expert_prefill_sweep", "shape": name, "hidden": hidden,
            "inter": inter, "slots": slots, "tokens": tokens, "bucket": tokens * k / slots}
    chosen, total, failed = {}, 0, 0
    for kernel, grid in (("w8a8_gate_up", GRID_GATE_UP), ("w8a8_down", GRID_DOWN)):
        results = []
        for tile in grid:
            rec = {**head, "kernel": kernel, "block_m": tile.block_m, "block": tile.block,
                   "num_warps": tile.num_warps, "num_stages": tile.num_stages,
                   "default": tile == DEFAULTS[kernel]}
            try:
                rec.update(_check_and_time(kernel, tile, case))
            except Exception as e:  # noqa: BLE001 - a tile out of resources, not the run
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            emit(rec)
            results.append((tile, rec))
        total += len(results)
        failed += sum(not r["ok"] for _, r in results)
        pick = choose(results, min_gain)
        if pick is not None:
            default_us = next((r["us"] for _, r in results if r["default"] and r["ok"]), None)
            chosen[kernel] = (pick[0], {**pick[1], "default_us": default_us})
    return chosen, total, failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="8192", help="comma-separated token counts")
    p.add_argument("--shape", action="append", choices=list(SHAPES), default=None,
                   help="expert shape (repeatable; default both)")
    p.add_argument("--sweep", action="store_true",
                   help="check and time every tile of GRID_GATE_UP and GRID_DOWN")
    p.add_argument("--min-gain", type=float, default=0.03,
                   help="--sweep: a tile must beat the first guess by this fraction")
    p.add_argument("--write-table", type=Path, action="append", default=[], metavar="PATH",
                   help="--sweep: merge the chosen tiles into this .json table, or into "
                        "<device slug>.json in this directory (repeatable)")
    args = p.parse_args()
    try:  # a sweep takes minutes: refuse a table it could not merge into before it
        check_table_targets(args.write_table, None)
    except (TileTableError, OSError) as e:
        print(f"bench.fp8_expert_prefill: error: --write-table: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench.fp8_expert_prefill needs CUDA", file=sys.stderr)
        return 2
    if args.write_table and not args.sweep:
        print("--write-table needs --sweep", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's float32 products
    t_start, tag = time.time(), {"commit": commit(), "device": torch.cuda.get_device_name()}
    try:
        check_table_targets(args.write_table, tag["device"])
    except (TileTableError, OSError) as e:
        print(f"bench.fp8_expert_prefill: error: --write-table: {e}", file=sys.stderr)
        return 2

    def emit(rec: dict) -> None:
        print(json.dumps({**rec, **tag}), flush=True)

    rate = fp8_matmul_rate("cuda")
    entries, measured, total, failed = [], {}, 0, 0
    source = f"python -m bench.fp8_expert_prefill --sweep at {tag['commit']}"
    for name in args.shape or list(SHAPES):
        hidden, inter, slots, k = SHAPES[name]
        weights = _experts(hidden, inter, slots, torch.Generator(device="cuda").manual_seed(0))
        for tokens in (int(v) for v in args.tokens.split(",")):
            swept = None
            if args.sweep:
                chosen, n, bad = sweep(name, weights, tokens, args.min_gain, emit)
                total, failed = total + n, failed + bad
                for kernel, (tile, rec) in chosen.items():
                    entries.append(Entry(kernel, hidden, inter, rec["bucket"], tile))
                    measured[(kernel, hidden, inter, rec["bucket"])] = {
                        "tokens": tokens, "slots": slots, "us": rec["us"],
                        "default_us": rec["default_us"]}
                if len(chosen) == 2:
                    swept = (chosen["w8a8_gate_up"][0], chosen["w8a8_down"][0])
                for path in args.write_table:  # after each case: a timeout keeps the rest
                    write_merged(path, tag["device"], entries, source, measured)
            print(json.dumps(measure(name, weights, tokens, rate, swept)), flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.sweep:
        emit({"bench": "fp8_expert_prefill_sweep_summary", "configs": total,
              "passed": total - failed, "failed": failed,
              "best": [{"kernel": e.kernel, "hidden": e.hidden, "inter": e.inter,
                        "bucket": e.bucket, "block_m": e.tile.block_m, "block": e.tile.block,
                        "num_warps": e.tile.num_warps, "num_stages": e.tile.num_stages,
                        **measured[(e.kernel, e.hidden, e.inter, e.bucket)]}
                       for e in entries],
              "table_slug": device_slug(tag["device"]),
              "seconds": round(time.time() - t_start, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
