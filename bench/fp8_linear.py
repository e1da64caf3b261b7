"""FP8 dense projections against bf16 ones and against their bounds, one run.

For each projection shape ``[N, K]`` (Qwen3-30B-A3B's fused qkv and o; DeepSeek-V3's
q_a, q_b, kv_a, o, shared-expert gate and down, and dense-layer gate by default) and
each M, it times :func:`elasticep.models.fp8_linear.fp8_linear_triton` (weight-only:
1 byte a weight plus its block scales, bf16 tensor cores), the W8A8 product on FP8
tensor cores (:func:`elasticep.models.fp8_prefill.fp8_linear_w8a8`, activations
quantized per token per 128 columns; its quantizer also timed alone) and
``torch.nn.functional.linear`` on the bf16 weight of the same shape. The weight-only and
bf16 times are divided by their bytes (weights, scales, activations in, outputs out)
over a device-to-device copy's bandwidth measured in the same run: ``bound = bytes /
copy bandwidth``. The W8A8 time is divided by the larger of its bytes' time and its
FLOPs over the FP8 matmul rate measured in the same run
(:func:`bench.prefill.fp8_matmul_rate`, an ``8192^3`` FP8 ``torch._scaled_mm``):
``w8a8_x_bound``. ``w8a8_path`` is what :func:`~elasticep.models.fp8_prefill.choose_path`
picks for the shape (with the probe's answer and the current
:data:`~elasticep.models.fp8_prefill.W8A8_MIN_M`); comparing ``w8a8_us`` with ``fp8_us``
across M is how that threshold is chosen. At prefill sizes it also gives TFLOP/s.

All are timed as a CUDA graph of back-to-back calls (as decode runs them), each call
on the next of several weight copies that together exceed the L2 cache, so every
weight byte comes from HBM. ``--sweep`` also times a few other tiles of the kernel and
reports the best one (for tuning :data:`~elasticep.models.fp8_linear.DECODE_TILE` and
its siblings).

Prints one JSON line per (shape, M). GPU only.

    python -m bench.fp8_linear [--m 1,16,64,256,1024,8192] [--shape qkv=5120x2048] [--sweep]
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
from bench.prefill import fp8_matmul_rate
from bench.spike_stream_wait import replay_ms
from elasticep.models import fp8_prefill
from elasticep.models.fp8_linear import fp8_linear_reference, fp8_linear_triton, plan, sm_count
from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_activations import quantize_activations

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


def w8a8_fields(x: torch.Tensor, q: list, n: int, k: int, copies: int, copy_bw: float,
                fp8_rate: float, bf16_us: float, fp8_us: float,
                support: fp8_prefill.BlockwiseSupport) -> dict:
    """The W8A8 product's record fields at ``x [m, k] x [n, k]^T`` (None where the probe
    found the recipe unusable or the shape is one it does not take)."""
    m = x.shape[0]
    path = fp8_prefill.choose_path(max(m, fp8_prefill.W8A8_MIN_M), n, k, x.dtype, support)
    rec = {"w8a8_path": fp8_prefill.choose_path(m, n, k, x.dtype, support)}
    if path != "w8a8":
        why = support.reason if not support.usable else "choose_path does not take this shape"
        return {**rec, "w8a8_us": None, "w8a8_why_not": why}
    ref = fp8_prefill.w8a8_reference(x, *q[0]).float()
    got = fp8_prefill.fp8_linear_w8a8(x, *q[0]).float()
    w8a8_us = graph_us(lambda i: fp8_prefill.fp8_linear_w8a8(x, *q[i]), copies)
    quant_us = graph_us(lambda i: quantize_activations(x, fp8_prefill.ROW_MULTIPLE), copies)
    w8a8_bytes = n * k + 4 * q[0][1].numel() + 2 * m * (k + n)
    bound_s = max(2 * m * n * k / fp8_rate, w8a8_bytes / copy_bw)
    return {**rec, "w8a8_us": round(w8a8_us, 2), "act_quant_us": round(quant_us, 2),
            "w8a8_over_bf16": round(w8a8_us / bf16_us, 3),
            "w8a8_over_fp8": round(w8a8_us / fp8_us, 3),
            "w8a8_bound_us": round(bound_s * 1e6, 2),
            "w8a8_x_bound": round(w8a8_us / 1e6 / bound_s, 2),
            "w8a8_tflops": round(2 * m * n * k / w8a8_us / 1e6, 1),
            "w8a8_rel_err_vs_reference": float((got - ref).abs().max() / ref.abs().max())}


def measure(name: str, n: int, k: int, m: int, copy_bw: float, sweep: bool,
            fp8_rate: float, support: fp8_prefill.BlockwiseSupport) -> dict:
    """One JSON record: the FP8 kernels and bf16 ``F.linear`` at ``[m, k] x [n, k]^T``."""
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
        "fp8_mm_tflops": round(fp8_rate / 1e12, 1),
        **w8a8_fields(x, q, n, k, copies, copy_bw, fp8_rate, bf16_us, fp8_us, support),
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
    p.add_argument("--m", default="1,16,64,256,1024,8192", help="comma-separated row counts")
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
    fp8_rate = fp8_matmul_rate("cuda")
    support = fp8_prefill.blockwise_support(torch.device("cuda"))
    print(f"bench.fp8_linear: blockwise scaled_mm probe: {support}", file=sys.stderr)
    for name, (n, k) in shapes.items():
        for m in (int(v) for v in args.m.split(",")):
            print(json.dumps(measure(name, n, k, m, copy_bw, args.sweep, fp8_rate, support)),
                  flush=True)
            torch.cuda.empty_cache()  # the last shape's weight copies
    return 0


if __name__ == "__main__":
    sys.exit(main())
