"""The FP8 prefill path (:mod:`elasticep.moe.experts.fp8_activations`,
:mod:`elasticep.models.fp8_prefill`) on the CPU.

The activation quantizer against a hand-computed case; its Triton kernel under
``TRITON_INTERPRET=1`` bit for bit against the torch reference, in ``scaled_mm``'s
layout; the W8A8 reference against the exact reference within the error FP8 activations
bring; the error bound the GPU test and the probe use (an emulated truncating 13-bit
accumulator inside it, misplaced scales far outside); the dispatch rule as a pure
function; the weight scales' layout; the glue around ``scaled_mm`` against a CPU stand-in
that checks PyTorch's documented layout; the fallback when ``scaled_mm`` refuses a
product; and the CPU path unchanged. tests/test_fp8_prefill_gpu.py runs the CUDA path
against these references.
"""

from __future__ import annotations

import json

import pytest
import torch
from _interpreted import run_interpreted

from elasticep.models.fp8_linear import fp8_linear_reference
from elasticep.models.fp8_prefill import (
    ACCUMULATION_ERROR,
    NOT_PROBED,
    W8A8_MIN_M,
    BlockwiseSupport,
    _weight_scales,
    choose_path,
    w8a8_error_bound,
    w8a8_reference,
)
from elasticep.models.linear import Fp8Weight, linear
from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_activations import (
    MIN_AMAX,
    dequantize_activations,
    quantize_activations_reference,
)

pytestmark = pytest.mark.timeout(120)


def _hand_case() -> torch.Tensor:
    """``[5, 384]`` float32 activations (K three groups, M prime) with known answers."""
    x = torch.zeros(5, 384)
    # row 0, group 0: amax 448, so scale 1 and q = x rounded to e4m3
    x[0, :8] = torch.tensor([448.0, 1.0625, 1.1875, 3.0, -0.0004, 0.0015, 300.0, -17.0])
    # row 0, group 1: amax 7, scale 7/448 = 2^-6 exactly
    x[0, 128:131] = torch.tensor([7.0, 3.5, 0.1])
    # row 0, group 2 and row 1: zeros. Row 2: row 3 with one huge value in group 1.
    gen = torch.Generator().manual_seed(3)
    x[3] = torch.randn(384, generator=gen)
    x[2] = x[3]
    x[2, 200] = 1e30
    x[4] = torch.randn(384, generator=gen) * 1e-3
    return x


def test_quantizer_on_a_hand_computed_case():
    x = _hand_case()
    q, s = quantize_activations_reference(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 384)
    assert s.dtype == torch.float32 and s.shape == (5, 3)
    tiny = MIN_AMAX / 448
    assert s[0].tolist() == [1.0, 2.0 ** -6, pytest.approx(tiny, rel=1e-6)]
    # nearest e4m3, ties to even: 1.0625 -> 1 (1.000b), 1.1875 -> 1.25 (1.010b), -17 ->
    # -16 (values 2 apart there); 300 -> 288 (32 apart); -0.0004 -> -0 (under half the
    # subnormal step 2^-9, the sign kept); 0.0015 -> 2^-9
    assert q[0, :8].float().tolist() == [448.0, 1.0, 1.25, 3.0, -0.0, 2.0 ** -9, 288.0, -16.0]
    assert torch.signbit(q[0, 4].float())
    assert q[0, 128:131].float().tolist() == [448.0, 224.0, 6.5]  # 0.1 / 2^-6 = 6.4 -> 6.5
    assert not q[0, 256:].float().any() and not q[1].float().any()
    assert torch.equal(s[1], torch.full((3,), tiny))
    # the huge value owns its group (the rest of it flushes to zero); the other groups
    # of its row are quantized as without it
    assert s[2, 1] == pytest.approx(1e30 / 448, rel=1e-6) and q[2, 200].float() == 448
    assert not q[2, 128:256].float()[torch.arange(128) != 72].any()
    for g in (0, 2):
        cols = slice(128 * g, 128 * g + 128)
        assert s[2, g] == s[3, g] and torch.equal(q[2, cols].float(), q[3, cols].float())
    # every row: scale = amax / 448 per group, and q * scale within 2^-4 of x (normal
    # range) or 2^-10 * scale (subnormal)
    for r in (3, 4):
        amax = x[r].view(3, 128).abs().amax(dim=1)
        assert torch.equal(s[r], amax / 448)
    xd = dequantize_activations(q, s)
    each = s.repeat_interleave(128, dim=1)
    ok = (xd - x).abs() <= torch.maximum(2.0 ** -4 * x.abs(), 2.0 ** -10 * each)
    assert bool(ok[[0, 3, 4]].all())
    # bf16 and float32 inputs holding the same values quantize alike; K not a multiple
    # of 128 gets a partial last group
    xb = x[3:].bfloat16()
    assert all(torch.equal(a.float(), b.float()) for a, b in
               zip(quantize_activations_reference(xb), quantize_activations_reference(xb.float()),
                   strict=True))
    qp, sp = quantize_activations_reference(x[3:, :300])
    assert sp.shape == (2, 3) and torch.equal(sp[:, 2], x[3:, 256:300].abs().amax(dim=1) / 448)
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        quantize_activations_reference(x[0])


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool = False, seed: int = 0):
    """Activations ``[m, k]`` spanning two decades across columns, an FP8 weight
    ``[n, k]`` whose block scales span three, and a bias."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 0, k)[None, :]
    q, s = fp8_block.quantize(w)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(0, -2, k)[None, :]).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, q, s, b


def test_w8a8_reference_is_the_exact_product_within_activation_rounding():
    x, q, s, b = _case(37, 200, 384, torch.float32, bias=True)
    exact = fp8_linear_reference(x, q, s, b)
    got = w8a8_reference(x, q, s, b)
    w = fp8_block.dequantize(q, s)
    xq, xs = quantize_activations_reference(x)
    xd = dequantize_activations(xq, xs)
    # each activation moves by at most 2^-4 of itself (normal e4m3) or 2^-10 of its
    # group's scale (subnormal): the product by at most that, times |W|
    step = torch.maximum(2.0 ** -4 * x.abs(), 2.0 ** -10 * xs.repeat_interleave(128, dim=1))
    assert bool(((xd - x).abs() <= step).all())
    bound = step @ w.abs().T + 1e-5 * (exact.abs() + 1)  # + float32 sums and rounding
    assert bool(((got - exact).abs() <= bound).all())
    # and it does move: by about the activations' own relative rounding, since the
    # weights mix the errors of independent elements
    rel_x = float((xd - x).norm() / x.norm())
    rel_y = float((got - exact).norm() / (exact - b).norm())
    assert 0.01 < rel_x < 0.05 and 0.6 < rel_y / rel_x < 1.6, (rel_x, rel_y)
    # bf16: one rounding of the product, then the bias added in bf16
    xb, bb = x.bfloat16(), b.bfloat16()
    xdb = dequantize_activations(*quantize_activations_reference(xb))
    want = (xdb @ w.T).bfloat16() + bb
    assert torch.equal(w8a8_reference(xb, q, s, bb), want)
    assert w8a8_reference(xb.view(37, 1, 384), q, s).shape == (37, 1, 200)


def test_error_bound_passes_accumulation_error_and_fails_a_misplaced_scale():
    x, q, s, _ = _case(40, 256, 640, torch.bfloat16, seed=1)
    ref = w8a8_reference(x, q, s).float()
    bound = w8a8_error_bound(x, q, s)
    xd = dequantize_activations(*quantize_activations_reference(x))
    mag = xd.abs() @ fp8_block.dequantize(q, s).abs().T
    # the accumulation error the bound allows, one bf16 rounding each side: inside
    sign = torch.where(torch.rand(ref.shape, generator=torch.Generator().manual_seed(2)) < 0.5,
                       -1.0, 1.0)
    near = ref + sign * (0.95 * ACCUMULATION_ERROR * mag + 2.0 ** -8 * ref.abs())
    assert float(((near - ref).abs() / bound).max()) <= 1
    # the weight's scale blocks read in the wrong order (scale_b's layout mistaken)
    wrong = w8a8_reference(x, q, s.flip(1).contiguous()).float()
    assert float(((wrong - ref).abs() / bound).max()) > 10
    # one activation group's scale lost (a padded row read as a real one)
    xq, xs = quantize_activations_reference(x)
    xs[:, 2] = xs[:, 1]
    lost = (dequantize_activations(xq, xs) @ fp8_block.dequantize(q, s).T).bfloat16().float()
    assert float(((lost - ref).abs() / bound).max()) > 10


def _truncating_product(x, q, s, bits: int) -> torch.Tensor:
    """The W8A8 product with a narrow tensor-core accumulator, as the DeepSeek-V3 report
    (section 3.3.2) describes Hopper's: each 32-product step is added to the running sum
    of its 128-wide K block with every addend aligned to the largest exponent among them
    and truncated (toward minus infinity) to ``bits`` bits; each block's sum is promoted,
    scaled and added in float32, then rounded to ``x``'s dtype."""
    xq, xs = quantize_activations_reference(x)
    a, b = xq.double(), q.double()
    out = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float32)
    sb = s.repeat_interleave(128, dim=0)[:q.shape[0]]
    for kb in range(x.shape[1] // 128):
        d = torch.zeros(out.shape, dtype=torch.float64)
        for c in range(kb * 128, kb * 128 + 128, 32):
            p = a[:, None, c:c + 32] * b[None, :, c:c + 32]  # exact
            top = torch.maximum(d.abs(), p.abs().amax(-1)).clamp_min(1e-300)
            quantum = torch.exp2(torch.floor(torch.log2(top)) - (bits - 1))[..., None]
            d = (torch.floor(d[..., None] / quantum) * quantum)[..., 0] + (
                torch.floor(p / quantum) * quantum).sum(-1)
        out += (d * xs[:, kb, None].double() * sb[None, :, kb].double()).float()
    return out.to(x.dtype)


def test_error_bound_holds_for_a_truncating_13_bit_accumulator():
    for m, n, k in ((32, 256, 512), (16, 128, 2048)):
        x, q, s, _ = _case(m, n, k, torch.bfloat16, seed=k)
        ref = w8a8_reference(x, q, s).float()
        worst = float(((_truncating_product(x, q, s, 13).float() - ref).abs()
                       / w8a8_error_bound(x, q, s)).max())
        assert 0 < worst <= 0.8, (m, n, k, worst)


FULL = BlockwiseSupport(True, True, True, True, "test")


def test_choose_path_rule():
    m = W8A8_MIN_M
    # CPU (or a dtype the kernels do not take): the exact reference, at every size
    bf16 = torch.bfloat16
    assert choose_path(8192, 5120, 2048, None, FULL) == "reference"
    # decode sizes, and anything the probe has not vouched for: weight-only
    assert choose_path(m - 1, 5120, 2048, bf16, FULL) == "weight_only"
    assert choose_path(8192, 5120, 2048, bf16, NOT_PROBED) == "weight_only"
    assert choose_path(8192, 5120, 2048, bf16,
                       BlockwiseSupport(False, False, False, False, "refused")) == "weight_only"
    # Qwen3-30B-A3B's and DeepSeek-V3's projections at prefill sizes
    for n, k in ((5120, 2048), (2048, 4096), (1536, 7168), (24576, 1536), (576, 7168),
                 (7168, 16384), (18432, 7168)):
        assert choose_path(m, n, k, bf16, FULL) == "w8a8", (n, k)
    # K must be whole 128-column groups; N a multiple of 16 (scaled_mm's check)
    assert choose_path(m, 512, 300, bf16, FULL) == "weight_only"
    assert choose_path(m, 200, 512, bf16, FULL) == "weight_only"
    # K/128 not a multiple of 4 (scale_b padded) and N not of 128 (a partial weight
    # block) go W8A8 only where the probe checked that case
    aligned = BlockwiseSupport(True, False, False, False, "aligned bf16 only")
    assert choose_path(m, 512, 256, bf16, FULL) == "w8a8"
    assert choose_path(m, 512, 256, bf16, aligned) == "weight_only"
    assert choose_path(m, 576, 7168, bf16, aligned) == "weight_only"
    assert choose_path(m, 576, 7168, bf16, BlockwiseSupport(True, False, True, False, "")) == "w8a8"
    assert choose_path(m, 512, 512, bf16, aligned) == "w8a8"
    # fp16 activations (and output) only where the probe checked fp16
    assert choose_path(m, 512, 512, torch.float16, FULL) == "w8a8"
    assert choose_path(m, 512, 512, torch.float16, aligned) == "weight_only"


def test_weight_scales_in_scaled_mm_layout():
    s = torch.arange(15, dtype=torch.float32).view(3, 5) + 1  # N 3 blocks, K/128 = 5
    sb = _weight_scales(s)
    assert sb.shape == (8, 3) and sb.stride() == (1, 8)  # K/128 padded to 8, K-major
    assert torch.equal(sb[:5], s.t()) and not sb[5:].any()
    s4 = torch.ones(6, 8)[1:4, :4]  # rows of a wider tensor: a copy with stride 4
    assert _weight_scales(s4).stride() == (1, 4)
    s8 = torch.ones(3, 8)
    view = _weight_scales(s8)
    assert view.stride() == (1, 8) and view.data_ptr() == s8.data_ptr()  # no copy


def test_cpu_projection_stays_the_exact_reference_at_prefill_sizes():
    x, q, s, b = _case(W8A8_MIN_M + 3, 256, 512, torch.bfloat16, bias=True, seed=4)
    assert torch.equal(linear(x, Fp8Weight(q, s), b), fp8_linear_reference(x, q, s, b))


def _scaled_mm_as_documented(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
    """``scaled_mm``'s blockwise 1x128 x 128x128 product on the CPU, for the glue around
    it: PyTorch's checks of that recipe (aten/src/ATen/native/cuda/ScaledBlas.cpp,
    ``_scaled_block1x128_block128x128``, and the K/N multiples of 16), then each scale
    read where cuBLASLt reads it: ``scale_a[m, l]`` for row m's K block l, ``scale_b[l,
    j]`` for K block l of N block j."""
    from torch.nn.functional import ScalingType

    m, k = a.shape
    n = b.shape[1]
    blocks, nb = -(-k // 128), -(-n // 128)
    l4 = -(-blocks // 4) * 4
    assert (recipe_a, recipe_b) == (ScalingType.BlockWise1x128, ScalingType.BlockWise128x128)
    assert a.dtype == b.dtype == torch.float8_e4m3fn and k % 16 == 0 and n % 16 == 0
    assert a.stride(1) == 1 and b.stride(0) == 1  # row-major x column-major
    assert scale_a.shape == (m, blocks) and scale_a.stride(0) == 1
    assert scale_a.stride(1) == m or blocks == 1
    assert scale_b.shape == (l4, nb) and scale_b.stride(0) == 1
    assert scale_b.stride(1) == l4 or nb == 1
    sa = scale_a.repeat_interleave(128, dim=1)[:, :k]
    sb = scale_b[:blocks].repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
    return ((a.float() * sa) @ (b.float() * sb)).to(output_dtype)


def _interpreted_results() -> dict:
    from elasticep.models import fp8_prefill
    from elasticep.models.fp8_linear import fp8_linear_triton
    from elasticep.models.fp8_prefill import _probe_one
    from elasticep.moe.experts.fp8_activations import quantize_activations

    out = {}
    base = _hand_case()
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(37, 384, generator=gen) * torch.logspace(-3, 2, 384)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for name, x, rows in (("hand", base, 16), ("random", big, 16), ("random_k300", big[:, :300], 1)):
            if dtype == torch.float16 and name == "hand":
                continue  # 1e30 is no fp16 value
            x = x.to(dtype)
            q, s = quantize_activations(x, rows)
            qr, sr = quantize_activations_reference(x)
            m = x.shape[0]
            key = f"{name}_{str(dtype)[6:]}"
            out[key] = {
                "q_equal": torch.equal(q[:m].view(torch.uint8), qr.view(torch.uint8)),
                "s_equal": torch.equal(s[:m], sr),
                "rows": q.shape[0], "stride": list(s.stride()),
                "pad_zero": not q[m:].float().any(),
                "pad_scale": bool((s[m:] == MIN_AMAX / 448).all()),
            }
    # a strided row view (a column slice) reads right too
    wide = torch.cat([big, torch.ones(37, 5)], dim=1)[:, :384]
    q, s = quantize_activations(wide)
    out["strided"] = torch.equal(q.view(torch.uint8), quantize_activations_reference(wide)[0]
                                 .view(torch.uint8))
    # the probe on a device without the recipe (the CPU): a one-line reason, no raise
    out["probe_cpu"] = _probe_one(40, 256, 512, torch.bfloat16, torch.device("cpu"))
    # the W8A8 glue (row padding, the weight as its transpose, scale_b padded, the output
    # rows cut, the bias after) around a scaled_mm that checks the documented layout
    fp8_prefill.scaled_mm = _scaled_mm_as_documented
    for m, n, k, bias in ((37, 256, 512, True), (40, 192, 640, False), (3, 576, 1024, True)):
        x, q, s, b = _case(m, n, k, torch.bfloat16, bias=bias, seed=m)
        got = fp8_prefill.fp8_linear_w8a8(x.view(m, 1, k), q, s, b).view(m, n)
        ref = w8a8_reference(x, q, s, b)
        out[f"glue_{m}x{n}x{k}"] = float(((got.float() - ref.float()).abs()
                                          / w8a8_error_bound(x, q, s, b)).max())
    out["probe_documented"] = _probe_one(40, 192, 640, torch.bfloat16, torch.device("cpu"))
    # a product scaled_mm refuses at run time: the weight-only kernel serves it, and that
    # weight shape is not offered to scaled_mm again
    calls = []

    def refuses(*args, **kw):
        calls.append(1)
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore")

    fp8_prefill.scaled_mm = refuses
    x, q, s, b = _case(W8A8_MIN_M, 192, 512, torch.float32, bias=True, seed=9)
    first = fp8_prefill.w8a8_or_weight_only(x, q, s, b)
    again = fp8_prefill.w8a8_or_weight_only(x, q, s, b)
    want = fp8_linear_triton(x, q, s, b)
    out["refused"] = [len(calls), torch.equal(first, want), torch.equal(again, want),
                      [list(key[:2]) for key in fp8_prefill._refused]]
    return out


def test_quantizer_kernel_interpreted_matches_the_reference():
    res = run_interpreted(__file__, timeout_s=100)
    probe = res.pop("probe_cpu")
    assert probe.startswith("ValueError: Invalid scaling configuration"), probe
    assert res.pop("strided") is True
    glue = {key: res.pop(key) for key in list(res) if key.startswith("glue_")}
    assert len(glue) == 3 and all(v <= 1 for v in glue.values()), glue
    assert res.pop("probe_documented") is None
    assert res.pop("refused") == [1, True, True, [[192, 512]]]
    assert len(res) == 8, res
    for key, r in res.items():
        pad = 16 if not key.startswith("random_k300") else 1
        rows = -(-(5 if key.startswith("hand") else 37) // pad) * pad
        assert r == {"q_equal": True, "s_equal": True, "rows": rows, "stride": [1, rows],
                     "pad_zero": True, "pad_scale": True}, (key, r)


if __name__ == "__main__":
    print(json.dumps(_interpreted_results()))
