"""FP8 decode expert kernels against bf16 ones and against the bandwidth bound, one run.

For an expert shape (Qwen3-30B-A3B's by default: H 2048, moe_intermediate 768) and N
rows each on a random slot (decode at batch N/k), it times
:func:`elasticep.moe.experts.fp8_rows.swiglu_rows_fp8` (1 byte a weight plus the block
scales) and :func:`elasticep.moe.experts.small_batch_experts.swiglu_rows` (bf16, 2 bytes a
weight) on the same experts, and divides the bytes each must read by a device-to-device
copy's bandwidth measured in the same run: ``bound = bytes / copy bandwidth``. It also
checks each against its reference.

Prints one JSON line per (shape, rows). GPU only.

    python -m bench.fp8_experts [--rows 8,64] [--shape 2048x768 --shape 7168x2048]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench._commit import commit
from bench.expert_gemv import copy_bandwidth
from bench.gpu_run import _time_cuda as cuda_ms  # noqa: E402 - one CUDA-event median timer
from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_rows import swiglu_rows_fp8, swiglu_rows_fp8_reference
from elasticep.moe.experts.small_batch_experts import swiglu_rows


def measure(hidden: int, inter: int, slots: int, n: int, copy_bw: float) -> dict:
    """One JSON record: FP8 and bf16 per-row kernels at ``n`` rows over ``slots`` experts."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(hidden + n)
    w13 = (torch.randn(slots, 2 * inter, hidden, device=dev, generator=gen) * 0.02).bfloat16()
    w2 = (torch.randn(slots, hidden, inter, device=dev, generator=gen) * 0.02).bfloat16()
    q13, s13 = fp8_block.quantize(w13)
    q2, s2 = fp8_block.quantize(w2)
    rows = torch.randn(n, hidden, device=dev, generator=gen).bfloat16()
    tags = torch.randint(1, slots + 1, (n,), device=dev, generator=gen, dtype=torch.int32)
    touched = int(tags.unique().numel())
    weights = touched * 3 * inter * hidden
    scales = touched * (s13[0].numel() + s2[0].numel())
    fp8_bytes = weights + 4 * scales
    bf16_bytes = 2 * weights
    ref = swiglu_rows_fp8_reference(q13, s13, q2, s2, rows, tags).float()
    err = float((swiglu_rows_fp8(q13, s13, q2, s2, rows, tags).float() - ref).abs().max()
                / ref.abs().max())
    fp8_ms = cuda_ms(lambda: swiglu_rows_fp8(q13, s13, q2, s2, rows, tags), 50)
    bf16_ms = cuda_ms(lambda: swiglu_rows(w13, w2, rows, tags), 50)
    return {
        "bench": "fp8_experts", "commit": commit(), "device": torch.cuda.get_device_name(),
        "hidden": hidden, "moe_intermediate": inter, "slots": slots, "rows": n,
        "experts_touched": touched, "copy_bw_GBps": round(copy_bw / 1e9, 1),
        **versus_bound(fp8_ms * 1e3, bf16_ms * 1e3, fp8_bytes, bf16_bytes, copy_bw),
        "fp8_rel_err_vs_reference": err,
    }


def versus_bound(fp8_us: float, bf16_us: float, fp8_bytes: int, bf16_bytes: int,
                 copy_bw: float) -> dict:
    """The record fields of an FP8 and a bf16 time (microseconds) against each other and
    against their bytes over the copy bandwidth (bytes per second)."""
    return {
        "fp8_us": round(fp8_us, 2), "bf16_us": round(bf16_us, 2),
        "fp8_over_bf16": round(fp8_us / bf16_us, 3),
        "fp8_bound_us": round(fp8_bytes / copy_bw * 1e6, 2),
        "bf16_bound_us": round(bf16_bytes / copy_bw * 1e6, 2),
        "fp8_x_bound": round(fp8_us / 1e6 / (fp8_bytes / copy_bw), 2),
        "bf16_x_bound": round(bf16_us / 1e6 / (bf16_bytes / copy_bw), 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,64", help="comma-separated row counts (<= 64)")
    p.add_argument("--shape", action="append", default=None, metavar="HxI",
                   help="hidden x moe_intermediate (repeatable; default 2048x768, 7168x2048)")
    p.add_argument("--slots", type=int, default=128, help="experts held (default 128)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench.fp8_experts needs CUDA", file=sys.stderr)
        return 2
    copy_bw = copy_bandwidth(torch.device("cuda"))
    for shape in args.shape or ["2048x768", "7168x2048"]:
        hidden, inter = (int(v) for v in shape.split("x"))
        slots = args.slots if hidden < 4096 else min(args.slots, 32)  # fit one GPU
        for n in (int(v) for v in args.rows.split(",")):
            print(json.dumps(measure(hidden, inter, slots, n, copy_bw)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
