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
torch reference and against the FP8 path with bf16 activations. ``--sweep`` times a few
other W8A8 tiles as well.

Prints one JSON line per (shape, tokens). GPU only.

    python -m bench.fp8_expert_prefill [--tokens 8192] [--shape qwen3-30b-a3b] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench._commit import commit
from bench.gpu_run import _time_cuda as cuda_ms  # one CUDA-event median timer
from bench.prefill import fp8_matmul_rate
from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_activations import quantize_activations
from elasticep.moe.experts.fp8_sorted import swiglu_sorted_fp8
from elasticep.moe.experts.fp8_tiled import swiglu_tiled_fp8, swiglu_w8a8_reference
from elasticep.moe.experts.tiled_experts import swiglu_tiled

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8)}
# (gate/up (BLOCK_M, warps, stages), down (BLOCK_M, BLOCK_N, warps, stages)) for --sweep
SWEEP = {
    "m64": ((64, 4, 3), (64, 128, 4, 3)),
    "m64s4": ((64, 4, 4), (64, 128, 4, 4)),
    "m128s4": ((128, 8, 4), (128, 128, 8, 4)),
    "m128dn256": ((128, 8, 3), (128, 256, 8, 3)),
}
REPS = 10


def _experts(hidden: int, inter: int, slots: int, gen: torch.Generator):
    """bf16 experts and their block-FP8 quantization, drawn 16 slots at a time."""
    parts = []
    for s0 in range(0, slots, 16):
        n = min(16, slots - s0)
        w13 = (torch.randn(n, 2 * inter, hidden, device="cuda", generator=gen)
               / hidden ** 0.5).bfloat16()
        w2 = (torch.randn(n, hidden, inter, device="cuda", generator=gen) / inter ** 0.5).bfloat16()
        parts.append((w13, *fp8_block.quantize(w13), w2, *fp8_block.quantize(w2)))
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def measure(name: str, weights: tuple, tokens: int, rate: float, sweep: bool) -> dict:
    """One JSON record: the three paths at ``tokens`` tokens of the ``name`` shape, on
    ``weights`` (:func:`_experts`)."""
    hidden, inter, slots, k = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    w13, q13, s13, w2, q2, s2 = weights
    rows = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    tags = (torch.rand(tokens, slots, device="cuda", generator=gen).topk(k, dim=1).indices
            .flatten() + 1)
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
    if sweep:
        for tile, (gu, dn) in SWEEP.items():
            try:
                times[f"w8a8_{tile}_ms"] = cuda_ms(
                    lambda gu=gu, dn=dn: swiglu_tiled_fp8(*fp8, rows, tags, row_repeat=k,
                                                          gate_up_tile=gu, down_tile=dn), REPS)
            except Exception as e:  # noqa: BLE001 - a tile out of resources, not the run
                times[f"w8a8_{tile}_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="8192", help="comma-separated token counts")
    p.add_argument("--shape", action="append", choices=list(SHAPES), default=None,
                   help="expert shape (repeatable; default both)")
    p.add_argument("--sweep", action="store_true", help="also time the SWEEP tiles")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench.fp8_expert_prefill needs CUDA", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's float32 products
    rate = fp8_matmul_rate("cuda")
    for name in args.shape or list(SHAPES):
        hidden, inter, slots, _ = SHAPES[name]
        weights = _experts(hidden, inter, slots, torch.Generator(device="cuda").manual_seed(0))
        for tokens in (int(v) for v in args.tokens.split(",")):
            print(json.dumps(measure(name, weights, tokens, rate, args.sweep)), flush=True)
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
