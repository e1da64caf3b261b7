"""FP8 dense projections against bf16 ones and against the bandwidth bound, one run.

For each projection shape ``[N, K]`` (Qwen3-30B-A3B's fused qkv and o; DeepSeek-V3's
q_a, q_b, kv_a, o, shared-expert gate and down, and dense-layer gate by default) and
each M, it times :func:`elasticep.models.fp8_linear.fp8_linear_triton` (1 byte a
weight plus its block scales) and ``torch.nn.functional.linear`` on the bf16 weight of
the same shape, and divides the bytes each must read (weights, scales, activations in,
outputs out) by a device-to-device copy's bandwidth measured in the same run:
``bound = bytes / copy bandwidth``. At prefill sizes it also gives each one's TFLOP/s.

Both are timed as a CUDA graph of back-to-back calls (as decode runs them), each call
on the next of several weight copies that together exceed the L2 cache, so every
weight byte comes from HBM. ``--sweep`` also times a few other tiles of the kernel and
reports the best one (for tuning :data:`~elasticep.models.fp8_linear.DECODE_TILE` and
its siblings).

Prints one JSON line per (shape, M). GPU only.

    python -m bench.fp8_linear [--m 1,16,64,256,8192] [--shape qkv=5120x2048] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from triton.runtime.errors import OutOfResources

from bench._commit import commit
from bench.expert_gemv import copy_bandwidth
from bench.fp8_experts import versus_bound
from bench.spike_stream_wait import replay_ms
from elasticep.models.fp8_linear import fp8_linear_reference, fp8_linear_triton, plan, sm_count
from elasticep.moe.experts import fp8_block

SHAPES = {
    "qwen3-30b-a3b.qkv": (5120, 2048), "qwen3-30b-a3b.o": (2048, 4096),
    "deepseek-v3.q_a": (1536, 7168), "deepseek-v3.q_b": (24576, 1536),
    "deepseek-v3.kv_a": (576, 7168), "deepseek-v3.o": (7168, 16384),
    "deepseek-v3.shared_gate": (2048, 7168), "deepseek-v3.shared_down": (7168, 2048),
    "deepseek-v3.dense_gate": (18432, 7168),
}
SWEEP = [(16, 16, 1, 4, 4), (16, 32, 1, 4, 4), (16, 64, 1, 4, 4), (16, 32, 2, 4, 4),
         (16, 32, 4, 4, 4), (16, 64, 4, 4, 3), (64, 64, 1, 4, 3), (64, 128, 1, 4, 3),
         (64, 128, 1, 4, 4), (128, 128, 1, 8, 2), (128, 128, 1, 8, 3), (128, 64, 1, 4, 3)]
L2_MULTIPLE = 4  # weight copies span this many L2 caches
CALLS = 20  # calls per graph replay


def graph_us(fn, copies: int) -> float:
    """Microseconds per call of ``fn(i)`` (``i`` the weight copy), as the median replay of
    a CUDA graph of :data:`CALLS` calls over the copies in turn."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(CALLS):
            fn(c % copies)
    times = replay_ms(graph, 20)
    return sorted(times)[len(times) // 2] * 1e3 / CALLS


def measure(name: str, n: int, k: int, m: int, copy_bw: float, sweep: bool) -> dict:
    """One JSON record: the FP8 kernel and bf16 ``F.linear`` at ``[m, k] x [n, k]^T``."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n + k + m)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    copies = max(2, -(-L2_MULTIPLE * l2 // (n * k)))
    w = [(torch.randn(n, k, device=dev, generator=gen) * 0.02).bfloat16() for _ in range(copies)]
    q = [fp8_block.quantize(t) for t in w]
    x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
    ref = fp8_linear_reference(x, *q[0]).float()
    err = float((fp8_linear_triton(x, *q[0]).float() - ref).abs().max() / ref.abs().max())
    act = 2 * m * (k + n)
    fp8_bytes = n * k + 4 * q[0][1].numel() + act
    bf16_bytes = 2 * n * k + act
    tile = plan(m, n, k, sm_count(dev))
    fp8_us = graph_us(lambda i: fp8_linear_triton(x, *q[i]), copies)
    bf16_us = graph_us(lambda i: torch.nn.functional.linear(x, w[i]), copies)
    rec = {
        "bench": "fp8_linear", "commit": commit(), "device": torch.cuda.get_device_name(),
        "shape": name, "n": n, "k": k, "m": m, "tile": list(tile),
        "copy_bw_GBps": round(copy_bw / 1e9, 1),
        **versus_bound(fp8_us, bf16_us, fp8_bytes, bf16_bytes, copy_bw),
        "fp8_rel_err_vs_reference": err,
    }
    if m >= 1024:
        rec["fp8_tflops"] = round(2 * m * n * k / fp8_us / 1e6, 1)
        rec["bf16_tflops"] = round(2 * m * n * k / bf16_us / 1e6, 1)
    if sweep:
        timed, too_big = [], []
        for t in SWEEP:
            if m <= 64 and not m <= t[0] <= 64:  # decode: one M tile, as plan's
                continue
            try:
                timed.append((graph_us(lambda i, t=t: fp8_linear_triton(x, *q[i], tile=t),
                                       copies), t))
            except OutOfResources:  # more shared memory than the GPU has
                too_big.append(list(t))
        best = min(timed)
        rec["best_tile"], rec["best_us"], rec["tiles_too_big"] = list(best[1]), round(best[0], 2), too_big
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="1,16,64,256,8192", help="comma-separated row counts")
    p.add_argument("--shape", action="append", default=None, metavar="NAME=NxK",
                   help=f"projection shape (repeatable; default: {', '.join(SHAPES)})")
    p.add_argument("--sweep", action="store_true", help="also time other tiles, report the best")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench.fp8_linear needs CUDA", file=sys.stderr)
        return 2
    shapes = dict(SHAPES)
    if args.shape:
        try:
            shapes = {s.split("=")[0]: tuple(int(v) for v in s.split("=")[1].split("x"))
                      for s in args.shape}
        except (IndexError, ValueError):
            print(f"--shape takes NAME=NxK, got {args.shape}", file=sys.stderr)
            return 2
    copy_bw = copy_bandwidth(torch.device("cuda"))
    for name, (n, k) in shapes.items():
        for m in (int(v) for v in args.m.split(",")):
            print(json.dumps(measure(name, n, k, m, copy_bw, args.sweep)), flush=True)
            torch.cuda.empty_cache()  # the last shape's weight copies
    return 0


if __name__ == "__main__":
    sys.exit(main())
