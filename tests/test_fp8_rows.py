"""The FP8 decode expert kernels (:mod:`elasticep.moe.experts.fp8_rows`) on the CPU.

The torch reference against an independent float32 SwiGLU on the dequantized weights,
and the Triton kernels under ``TRITON_INTERPRET=1`` against the reference, on widths
that are not multiples of 128 (a partial last block, and up rows that start inside a
scale block). The GPU test (tests/test_fp8_rows_gpu.py) runs the compiled kernels at
real shapes.
"""

from __future__ import annotations

import json

import pytest
import torch
from _interpreted import run_interpreted

from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_rows import swiglu_rows_fp8_reference
from elasticep_testkit.fp8_expert_check import rounding_bound

pytestmark = pytest.mark.timeout(200)


def make_case(slots: int, hidden: int, inter: int, n: int, dtype: torch.dtype, seed: int = 0):
    """FP8 experts, rows and tags (``n`` rows, some padding) for the kernel tests."""
    gen = torch.Generator().manual_seed(seed)
    w13, s13 = fp8_block.quantize(torch.randn(slots, 2 * inter, hidden, generator=gen) * 0.05)
    w2, s2 = fp8_block.quantize(torch.randn(slots, hidden, inter, generator=gen) * 0.05)
    rows = torch.randn(n, hidden, generator=gen).to(dtype)
    tags = torch.randint(0, slots + 1, (n,), generator=gen)
    tags[0], tags[-1] = 0, slots  # a padding row and the last slot
    return w13, s13, w2, s2, rows, tags


def test_reference_is_swiglu_on_dequantized_weights():
    w13, s13, w2, s2, rows, tags = make_case(4, 160, 72, 6, torch.float32)
    got = swiglu_rows_fp8_reference(w13, s13, w2, s2, rows, tags)
    for n, t in enumerate(tags.tolist()):
        if t == 0:
            assert not got[n].any()
            continue
        w_13 = fp8_block.dequantize(w13[t - 1], s13[t - 1])
        gate, up = (w_13 @ rows[n]).chunk(2)
        want = fp8_block.dequantize(w2[t - 1], s2[t - 1]) @ (torch.nn.functional.silu(gate) * up)
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-6)


def packed_case(slots: int, hidden: int, inter: int, n: int, dtype: torch.dtype, seed: int):
    """:func:`make_case` with the weights in packed slots, passed as their strided views
    (what :func:`~elasticep.moe.experts.expert_compute.grouped_swiglu` hands the kernels)."""
    w13, s13, w2, s2, rows, tags = make_case(slots, hidden, inter, n, dtype, seed)
    q13, t13 = fp8_block.unpack(fp8_block.pack(w13, s13), 2 * inter)
    q2, t2 = fp8_block.unpack(fp8_block.pack(w2, s2), hidden)
    return q13, t13, q2, t2, rows, tags


def _interpreted_errors() -> dict[str, float]:
    from elasticep.moe.experts.fp8_rows import swiglu_rows_fp8
    from elasticep.moe.experts.fp8_sorted import swiglu_sorted_fp8

    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        # H 160 (128 + 32), I 72: w13 has 144 rows, so up rows 72..143 straddle scale
        # rows 0 and 1; w2's 72 columns are one partial block
        case = make_case(3, 160, 72, 5, dtype, seed=1)
        got = swiglu_rows_fp8(*case).float()
        ref = swiglu_rows_fp8_reference(*case).float()
        out[name] = float(((got - ref).abs() / rounding_bound(*case)).max())
        out[name + "_padding_zero"] = float(got[0].abs().max())
        # packed slots (the packed tensor's slot stride), several rows a slot; I 128 as
        # packed slots need
        case = packed_case(4, 160, 128, 20, dtype, seed=2)
        ref = swiglu_rows_fp8_reference(*case).float()
        got = swiglu_rows_fp8(*case).float()
        out["packed_rows_" + name] = float(((got - ref).abs() / rounding_bound(*case)).max())
        if dtype == torch.float32:
            # the sorted-rows kernels (tl.dot): the interpreter's bf16 dot returns garbage
            # (the bf16 sorted_experts kernel's too), so bf16 runs in the GPU test only
            got = swiglu_sorted_fp8(*case).float()
            out["sorted_" + name] = float(((got - ref).abs() / rounding_bound(*case)).max())
            out["sorted_" + name + "_padding_zero"] = float(got[0].abs().max())
    return out


def test_kernels_interpreted_match_the_reference():
    errs = run_interpreted(__file__, timeout_s=180)
    assert all(v == 0 for k, v in errs.items() if k.endswith("_padding_zero")), errs
    # the largest difference over its rounding bound (rounding_bound): at most 1
    assert len(errs) == 8 and all(v <= 1 for k, v in errs.items()), errs


if __name__ == "__main__":
    print(json.dumps(_interpreted_errors()))
