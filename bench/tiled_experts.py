"""Prefill-sized expert compute: the tiled grouped GEMM against the FLOP bound.

For Qwen3-30B-A3B's expert shape (H 2048, moe_intermediate 768, 128 slots, bf16) and
``--rows`` (token, expert) rows routed at random (an 8192-token prefill step has 65,536),
it times :func:`elasticep.moe.experts.tiled_experts.swiglu_tiled` under several tiles (and,
as ``repeat``, at its default tile reading each token's row for its 8 pairs; as
``in_place_wW``, reading rows in place with row stride W as the exchange hands them) and the
sorted-rows kernels, and divides the SwiGLU FLOPs
(``2 x N x 3 x H x I``) by the time, against an 8192^3 bf16 matmul measured in the same
run. Prints one JSON line per (rows, variant). GPU only.

    python -m bench.tiled_experts [--rows 2048,8192,16384,65536]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.gpu_run import _time_cuda
from bench.prefill import matmul_rate
from elasticep.moe.exchange.padded_exchange import row_width
from elasticep.moe.experts.expert_compute import grouped_swiglu
from elasticep.moe.experts.sorted_experts import swiglu_sorted
from elasticep.moe.experts.tiled_experts import swiglu_tiled

TILES = {  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): gate/up, down
    "t64": ((64, 64, 64, 4, 4), (64, 128, 64, 4, 4)),
    "t64s3": ((64, 64, 64, 4, 3), (64, 128, 64, 4, 3)),
    "t128": ((128, 64, 64, 8, 3), (128, 128, 64, 8, 3)),
    "t128n128": ((128, 128, 64, 8, 3), (128, 128, 64, 8, 3)),
    "t64n128": ((64, 128, 64, 4, 3), (64, 128, 64, 4, 3)),
    "t128s4": ((128, 128, 64, 8, 4), (128, 128, 64, 8, 4)),
    "t128k128": ((128, 128, 128, 8, 3), (128, 128, 128, 8, 3)),
    "t128dn256": ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3)),
    "t64dn256": ((64, 128, 64, 4, 4), (64, 256, 64, 8, 3)),
}
TOP_K = 8  # the "repeat" variant: top-k pairs per token read their token's row in place


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2048,8192,16384,65536")
    ap.add_argument("--experts", type=int, default=128)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rate = matmul_rate("cuda")
    S, H, inter = args.experts, 2048, 768
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(S, 2 * inter, H, generator=g, device=dev) / H**0.5).bfloat16()
    w2 = (torch.randn(S, H, inter, generator=g, device=dev) / inter**0.5).bfloat16()
    for n in (int(x) for x in args.rows.split(",")):
        rows = torch.randn(n, H, generator=g, device=dev).bfloat16()
        tags = torch.randint(1, S + 1, (n,), generator=g, device=dev, dtype=torch.int32)
        ref = grouped_swiglu(w13, w2, rows, tags, use_grouped=False).float()
        variants = {"sorted": lambda r=rows, t=tags: swiglu_sorted(w13, w2, r, t)}
        for name, (gu, dn) in TILES.items():
            variants[name] = (lambda r=rows, t=tags, gu=gu, dn=dn:
                              swiglu_tiled(w13, w2, r, t, gate_up_tile=gu, down_tile=dn))
        # as the same-host exchange hands them over: read in place from its receive rows
        # (row stride W), at the old width (values + tag, 16-byte rows) and the aligned one
        for w in sorted({H + 8, row_width(H, rows.dtype)}):
            buf = rows.new_zeros(n, w)
            buf[:, :H] = rows
            variants[f"in_place_w{w}"] = (lambda r=buf[:, :H], t=tags:
                                          swiglu_tiled(w13, w2, r, t))
        tok = rows[::TOP_K]  # as the single-rank executor hands them over
        ref_tok = grouped_swiglu(w13, w2, tok.repeat_interleave(TOP_K, 0), tags,
                                 use_grouped=False).float()
        variants["repeat"] = (lambda r=tok, t=tags:
                              swiglu_tiled(w13, w2, r, t, row_repeat=TOP_K))
        flops = 2 * n * 3 * H * inter
        for name, fn in variants.items():
            try:
                want = ref_tok if name == "repeat" else ref
                err = float((fn().float() - want).norm() / want.norm())
                ms = _time_cuda(fn, 10)
                row = {"section": "tiled_experts", "rows": n, "experts": S, "variant": name,
                       "ms": round(ms, 3), "tflop_per_s": round(flops / ms / 1e9, 1),
                       "x_matmul_bound": round(ms / (flops / rate * 1e3), 2), "rel_err": err}
            except Exception as exc:  # noqa: BLE001 - one variant's failure, not the run
                row = {"section": "tiled_experts", "rows": n, "variant": name,
                       "error": f"{type(exc).__name__}: {exc}"[:500]}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
