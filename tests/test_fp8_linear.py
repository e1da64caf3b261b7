"""The FP8 dense projection (:mod:`elasticep.models.fp8_linear`) on the CPU.

The torch reference against a hand-computed block sum, and the Triton kernels under
``TRITON_INTERPRET=1`` against the reference, on widths that are not multiples of 128
(partial last blocks both ways), at M = 1, 3, 64 (decode tiles) and 130 (prefill tiles,
two M tiles), with a bias, with K split over programs, and with strided activations.
The interpreter computes a bf16 ``tl.dot`` wrongly, so it runs float32 activations;
tests/test_fp8_linear_gpu.py runs the compiled kernels in bf16 at real shapes.
"""

from __future__ import annotations

import json

import pytest
import torch
from _interpreted import run_interpreted

from elasticep.models.fp8_linear import fp8_linear_reference
from elasticep.moe.experts import fp8_block

pytestmark = pytest.mark.timeout(200)


def make_case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool = False, seed: int = 0):
    """Activations ``[m, k]``, an FP8 weight ``[n, k]`` with its scales, and a bias."""
    gen = torch.Generator().manual_seed(seed)
    # block scales that differ by orders of magnitude, so a wrong block's scale shows
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, k)[None, :]
    q, s = fp8_block.quantize(w)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, q, s, b


def rounding_bound(x, q, s, bias=None) -> torch.Tensor:
    """How far a kernel that sums in another float32 order may land from the reference,
    per output element: each float32 sum of K products is within ``K * 2^-24 * (|x| @
    |W|^T)`` of the exact one (the standard bound for recursive summation), so the two
    are within twice that; each is then rounded once to the activation dtype, half a unit
    (``2^-p`` relative, p its mantissa bits) either way."""
    unit = torch.finfo(x.dtype).eps / 2
    w = fp8_block.dequantize(q, s)
    xf = x.float()
    y = xf @ w.T + (0 if bias is None else bias.float())
    mag = xf.abs() @ w.abs().T + (0 if bias is None else bias.float().abs())
    return 2 * unit * y.abs() + 2 * (q.shape[1] + 1) * 2 ** -24 * mag + 1e-30


def test_reference_is_the_blockwise_sum():
    x, q, s, b = make_case(3, 130, 260, torch.float32, bias=True)
    got = fp8_linear_reference(x, q, s, b)
    want = torch.zeros(3, 130, dtype=torch.float64)
    for bi in range(2):
        for bj in range(3):
            rows, cols = slice(128 * bi, 128 * bi + 128), slice(128 * bj, 128 * bj + 128)
            want[:, rows] += (x[:, cols].double() @ q[rows, cols].double().T) * float(s[bi, bj])
    want += b.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # bf16 activations: the float32 result rounded once
    xb = x.bfloat16()
    want_b = (xb.float() @ fp8_block.dequantize(q, s).T).bfloat16()
    assert torch.equal(fp8_linear_reference(xb, q, s), want_b)
    with pytest.raises(ValueError, match="must be float32 \\[2, 3\\]"):
        fp8_linear_reference(x, q, s[:1])


def test_decode_plans_read_each_weight_byte_once():
    from elasticep.models.fp8_linear import plan

    # shapes of Qwen3-30B-A3B (qkv, o) and DeepSeek-V3 (kv_a, o) on an H100's 132 SMs
    for (n, k), want_split in zip(((5120, 2048), (2048, 4096), (576, 7168), (7168, 16384)),
                                  (1, 3, 8, 1), strict=True):
        for m in range(1, 65):
            bm, bn, split, _, _ = plan(m, n, k, 132)
            # one M tile: each weight tile is loaded by one program per K range (the K
            # ranges of a split are disjoint runs of whole scale blocks, at least 4)
            assert bm >= m and split * 4 <= -(-k // 128), (m, n, k)
        # K is split only where the output tiles are fewer than the SMs
        assert plan(1, n, k, 132)[2] == want_split, (n, k)


def _interpreted_errors() -> dict[str, float]:
    from elasticep.models.fp8_linear import fp8_linear_triton, plan

    out = {}

    def check(name: str, x, q, s, b=None, tile=None) -> None:
        got = fp8_linear_triton(x, q, s, b, tile=tile)
        ref = fp8_linear_reference(x, q, s, b)
        out[name] = float(((got - ref).abs() / rounding_bound(x, q, s, b)).max())

    for m in (1, 3, 64, 130):
        # N 200 = 128 + 72 rows, K 300 = 128 + 128 + 44 columns
        check(f"m{m}", *make_case(m, 200, 300, torch.float32, bias=m in (3, 130), seed=m))
    # plan splits K 1100 (9 blocks) over 2 programs at decode sizes
    case = make_case(3, 200, 1100, torch.float32, bias=True, seed=5)
    out["plan_split"] = float(plan(3, 200, 1100, 132)[2])
    check("split_plan", *case)
    # one block a program, a partial one last; and a split prefill tile
    check("split3", *make_case(64, 72, 300, torch.float32, bias=True, seed=6),
          tile=(64, 32, 3, 4, 1))
    check("split2_m130", *make_case(130, 72, 300, torch.float32, seed=7), tile=(128, 64, 2, 4, 1))
    # strided activations (a column slice) and leading dimensions
    x, q, s, _ = make_case(5, 200, 300, torch.float32, seed=8)
    wide = torch.cat([x, torch.ones(5, 7)], dim=1)[:, :300]
    check("strided", wide, q, s)
    check("batched", x.view(5, 1, 300).expand(5, 2, 300), q, s)
    out["empty_rows"] = float(fp8_linear_triton(x[:0], q, s).shape == (0, 200)) - 1
    return out


def test_kernels_interpreted_match_the_reference():
    errs = run_interpreted(__file__, timeout_s=180)
    assert errs.pop("plan_split") == 2, errs
    assert errs.pop("empty_rows") == 0
    # the largest difference over its rounding bound (rounding_bound): at most 1
    assert len(errs) == 9 and all(v <= 1 for v in errs.values()), errs


if __name__ == "__main__":
    print(json.dumps(_interpreted_errors()))
