"""Prefill projections on FP8 tensor cores (W8A8): the dense projections of an FP8 model
at prefill sizes, with the activations quantized too.

DeepSeek-V3's recipe (report section 3.3): the activations ``x [M, K]`` quantized per
token per 128 columns (:mod:`elasticep.moe.experts.fp8_activations`), the weight ``W [N, K]``
as stored, float8_e4m3fn in 128 x 128 blocks with float32 ``scale_inv``, and the
product on FP8 tensor cores with each 128-wide K step's partial sum scaled by one
activation scale and one weight scale. The GEMM is PyTorch's
``torch.nn.functional.scaled_mm`` (cuBLASLt) with ``ScalingType.BlockWise1x128`` for
the activations and ``ScalingType.BlockWise128x128`` for the weights, in the layout its
checks ask for (PyTorch's ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` and
``test/test_scaled_matmul_cuda.py``):

- ``mat_a`` the FP8 activations ``[M, K]`` row-major; ``scale_a [M, K/128]`` float32
  with strides ``(1, M)``;
- ``mat_b`` the weight as ``W.T``, ``[K, N]`` column-major (Hopper takes row-major x
  column-major only); ``scale_b`` ``[L4, ceil(N/128)]`` with strides ``(1, L4)``, where
  ``L4`` is ``K/128`` rounded up to a multiple of 4: ``scale_inv`` with its columns
  zero-padded to ``L4``, transposed (the layout since PyTorch's fix for silently wrong
  128x128 products where K/128 is not a multiple of 4, pytorch/pytorch#166752; a torch
  with the older layout refuses the padded scales or misreads them, and the probe
  notices either);
- K and N multiples of 16, SM90 only, cuBLASLt 12.9 or newer.

Which path a projection takes is :func:`choose_path`, a pure function of the shape and
of what the probe found. :func:`blockwise_support` probes once per device at the first
call that could use the W8A8 path: four tiny products (bf16 with K a multiple of 512;
K/128 not a multiple of 4, so ``scale_b`` is padded; N not a multiple of 128; fp16, whose
output cuBLASLt may not offer for this recipe) checked against
:func:`w8a8_reference` within :func:`w8a8_error_bound`, and logs one line saying which
path prefill uses and why. Any failure (an old torch, another GPU, a cuBLAS that refuses
the recipe, a wrong result) leaves those shapes (or dtypes) on the weight-only Triton
kernel.

Numerics (CUDA path): activations rounded to e4m3 per 128-column group (at most ``2^-4``
relative, see :mod:`~elasticep.moe.experts.fp8_activations`); the tensor cores sum each
128-product K step with fewer bits than float32 before it is promoted, scaled and added
to a float32 accumulator (the DeepSeek-V3 report measured about 14 bits on Hopper); one
rounding to the activation dtype; the bias added after, in that dtype (one more
rounding). The CPU path keeps the exact reference
(:func:`~elasticep.models.fp8_linear.fp8_linear_reference`); :func:`w8a8_reference`
models the W8A8 numerics on any device, for the tests and the probe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from elasticep.models.fp8_linear import (
    check_fp8_weight,
    fp8_linear_ok,
    fp8_linear_reference,
    fp8_linear_triton,
)
from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_activations import (
    GROUP,
    dequantize_activations,
    quantize_activations,
    quantize_activations_reference,
)

try:
    from torch.nn.functional import ScalingType, scaled_mm
except ImportError:  # torch before the scaled_mm API (2.10): weight-only prefill
    scaled_mm = ScalingType = None

logger = logging.getLogger(__name__)

# The tensor-core summation error allowed against the reference, as a fraction of
# |x^| @ |W|^T: the DeepSeek-V3 report's 14 kept bits would stay within 2^-11, but an
# H100 (torch 2.11, cuBLASLt's blockwise kernel) came out at up to 1.8x that at the
# bench's shapes and 4.6x on a small probe. 2^-8 is about twice the error of rounding
# the weights to bf16; a scale block read in the wrong place is orders of magnitude out.
ACCUMULATION_ERROR = 2.0 ** -8
# Fewest rows for the W8A8 path: below it the weight-only kernel reads each weight byte
# once and the activation quantization is not repaid. A first guess, to be set from
# `python -m bench.fp8_linear --m 256,1024,8192` on the GPU.
W8A8_MIN_M = 256
# Rows of the quantized activations are padded to this (zeros), so scale_a's column
# stride is 16-byte aligned for cuBLASLt; the output keeps the first M rows.
ROW_MULTIPLE = 16
_K_ALIGN = 16  # scaled_mm's own check on K and N
_SCALE_COLS = 4  # cuBLASLt's 128x128 scales: K/128 padded to a multiple of this

Path = Literal["reference", "weight_only", "w8a8"]


@dataclass(frozen=True)
class BlockwiseSupport:
    """What the probe found ``scaled_mm``'s blockwise recipe does on one device.

    Attributes:
        usable: the recipe runs and is right with bf16 output where K/128 is a multiple
            of 4 and N of 128.
        padded_scales: also where K/128 is not a multiple of 4 (scale_b padded).
        partial_n: also where N is not a multiple of 128 (a partial last weight block).
        fp16: also with fp16 activations and output.
        reason: one line: what ran, or why not.
    """

    usable: bool
    padded_scales: bool
    partial_n: bool
    fp16: bool
    reason: str


NOT_PROBED = BlockwiseSupport(False, False, False, False, "not probed")


def choose_path(m: int, n: int, k: int, half: torch.dtype | None,
                support: BlockwiseSupport) -> Path:
    """The path of an ``[m, k] x [n, k]^T`` FP8 projection (pure).

    Args:
        m, n, k: rows, output features, input features.
        half: the activations' dtype where it is bf16/fp16 on CUDA with Triton present
            (:func:`~elasticep.models.fp8_linear.fp8_linear_ok`), else None.
        support: the device's probe result (:data:`NOT_PROBED` where none ran).

    Returns:
        ``"reference"`` (the exact float32 product: CPU, or another dtype),
        ``"weight_only"`` (the Triton kernel: decode sizes, and shapes the recipe does
        not take), or ``"w8a8"`` (:func:`fp8_linear_w8a8`): ``m >= W8A8_MIN_M``, the
        probe usable, K a multiple of 128, N of 16, and where K/128 is not a multiple
        of 4, N not of 128, or the activations fp16, the probe found that case right too.
    """
    if half is None:
        return "reference"
    if m < W8A8_MIN_M or not support.usable or k % GROUP or n % _K_ALIGN:
        return "weight_only"
    if half == torch.float16 and not support.fp16:
        return "weight_only"
    if (k // GROUP) % _SCALE_COLS and not support.padded_scales:
        return "weight_only"
    if n % fp8_block.BLOCK[0] and not support.partial_n:
        return "weight_only"
    return "w8a8"


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 product's numerics in float32: ``x`` quantized per token per 128 columns
    (:func:`~elasticep.moe.experts.fp8_activations.quantize_activations_reference`), both
    operands dequantized exactly, the product in float32, rounded once to ``x``'s dtype,
    then the bias added in that dtype (as :func:`fp8_linear_w8a8` adds it).

    Args:
        x: ``[..., K]`` activations, any float dtype, any device.
        q: ``[N, K]`` float8_e4m3fn weight; ``scale_inv`` its ``[ceil(N/128),
            ceil(K/128)]`` float32 scales; ``bias`` ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype.

    Raises:
        ValueError: a weight or scales of the wrong dtype or shape.
    """
    check_fp8_weight(q, scale_inv)
    x2 = x.reshape(-1, x.shape[-1])
    xd = dequantize_activations(*quantize_activations_reference(x2))
    y = (xd @ fp8_block.dequantize(q, scale_inv).T).to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.view(*x.shape[:-1], q.shape[0])


def w8a8_error_bound(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Per output element, how far the CUDA W8A8 product may land from
    :func:`w8a8_reference` (float32 ``[M, N]``, ``x`` flattened to ``[M, K]``).

    Both use the same FP8 operands; they differ in how the products are summed and
    rounded. The tensor cores sum each 128-product K step in a narrow accumulator before
    the float32 promotion: the DeepSeek-V3 report (section 3.3.2) measured about 14 bits
    kept on Hopper, the addends aligned to the largest exponent and the bits below
    truncated, so the errors of one 32-product instruction share a sign. Allowed here:
    :data:`ACCUMULATION_ERROR` of ``mag = |x^| @ |W|^T`` (x^ the dequantized
    activations), more than an emulation of that truncation needs
    (tests/test_fp8_prefill.py) since an H100 exceeded the report's figure. Float32 sums of K terms in two orders differ by at most ``2 K
    2^-24`` of ``mag``; each side rounds to the dtype once (half a unit each, ``2^-p``
    relative: together one unit), and once more where a bias is added.
    """
    x2 = x.reshape(-1, x.shape[-1])
    xd = dequantize_activations(*quantize_activations_reference(x2))
    w = fp8_block.dequantize(q, scale_inv)
    unit = torch.finfo(x.dtype).eps / 2
    y = (xd @ w.T).abs()
    mag = xd.abs() @ w.abs().T
    bound = (ACCUMULATION_ERROR + 2 * (q.shape[1] + 1) * 2.0 ** -24) * mag + 2 * unit * y
    if bias is not None:
        bound = bound + 2 * unit * (y + bias.float().abs())
    return bound + torch.finfo(torch.float32).tiny


def _weight_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """``scale_b`` for ``BlockWise128x128``: ``[L4, ceil(N/128)]`` float32 with strides
    ``(1, L4)`` (see the module); a view of ``scale_inv`` when K/128 is a multiple of 4."""
    blocks = scale_inv.shape[1]
    padded = -(-blocks // _SCALE_COLS) * _SCALE_COLS
    if padded == blocks and scale_inv.stride(0) == blocks:
        return scale_inv.t()
    return F.pad(scale_inv, (0, padded - blocks)).t()


def fp8_linear_w8a8(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` on FP8 tensor cores (CUDA, SM90, a torch with
    ``scaled_mm``): the activations quantized by one Triton kernel, the product by
    ``scaled_mm``'s blockwise recipe, the bias added after. Reads nothing on the host.

    Args:
        x: ``[..., K]`` bf16/fp16 activations on CUDA; K a multiple of 128.
        q: ``[N, K]`` float8_e4m3fn weight, unit column stride; N a multiple of 16.
        scale_inv: ``[ceil(N/128), K/128]`` float32 block scales.
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype.

    Raises:
        ValueError: a weight of the wrong dtype or shape, or ``x`` not ``[..., K]``.
        RuntimeError / NotImplementedError: from ``scaled_mm`` where the device or
            cuBLASLt does not take the recipe (:func:`choose_path` keeps those away).
    """
    check_fp8_weight(q, scale_inv)
    n, k = q.shape
    if x.shape[-1] != k:
        raise ValueError(f"activations [..., {x.shape[-1]}] do not match an FP8 weight [{n}, {k}]")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    xq, xs = quantize_activations(x2, ROW_MULTIPLE)
    out = scaled_mm(xq, q.t(), xs, ScalingType.BlockWise1x128, _weight_scales(scale_inv),
                    ScalingType.BlockWise128x128, output_dtype=x.dtype)[:m]
    if bias is not None:
        out.add_(bias.to(x.dtype))
    return out.view(*lead, n)


_support: dict[int, BlockwiseSupport] = {}
# (m, n, k, activation dtype) of the probe's products: K/128 = 4 and N = 2 blocks; K/128
# = 5 (scale_b padded to 8); N = 1.5 blocks; fp16. m = 40 is padded to 48 rows.
_PROBES = {"usable": (40, 256, 512, torch.bfloat16), "padded_scales": (40, 256, 640, torch.bfloat16),
           "partial_n": (40, 192, 512, torch.bfloat16), "fp16": (40, 256, 512, torch.float16)}


def _probe_one(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """None when ``fp8_linear_w8a8`` gives :func:`w8a8_reference`'s result within
    :func:`w8a8_error_bound` on one product of this shape, else why not (one line)."""
    gen = torch.Generator().manual_seed(m + n + k)
    # block scales three orders of magnitude apart, so a misplaced scale shows
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 0, k)[None, :]
    q, s = (t.to(device) for t in fp8_block.quantize(w))
    x = (torch.randn(m, k, generator=gen) * torch.logspace(0, -2, k)[None, :]).to(device)
    x = x.to(dtype)
    try:
        got = fp8_linear_w8a8(x, q, s).float()
    except Exception as e:  # noqa: BLE001 - any refusal means: not this path, never a crash
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    ref = w8a8_reference(x, q, s).float()
    worst = float(((got - ref).abs() / w8a8_error_bound(x, q, s)).max())
    return None if worst <= 1 else f"wrong result ({worst:.3g} x the error bound)"


def blockwise_support(device: torch.device) -> BlockwiseSupport:
    """The probe's answer for a CUDA ``device``, run once per process and device (the
    first call syncs the device; later calls read a dict). Never raises for a failed
    probe: that is an unusable answer. During a CUDA graph capture it runs nothing and
    returns :data:`NOT_PROBED` (not cached)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _support:
        return _support[index]
    if torch.cuda.is_current_stream_capturing():
        return NOT_PROBED
    errs = {name: "not tried" for name in _PROBES}
    if scaled_mm is None:
        found = BlockwiseSupport(False, False, False, False, f"torch {torch.__version__} has "
                                 "no torch.nn.functional.scaled_mm")
    else:
        errs = {name: _probe_one(*shape, torch.device("cuda", index))
                for name, shape in _PROBES.items()}
        usable = errs["usable"] is None
        found = BlockwiseSupport(
            usable, *(usable and errs[c] is None for c in ("padded_scales", "partial_n", "fp16")),
            "scaled_mm blockwise 1x128 x 128x128 checked on this device" if usable
            else f"scaled_mm blockwise 1x128 x 128x128 failed its probe: {errs['usable']}")
    _support[index] = found
    name = torch.cuda.get_device_name(index)
    if found.usable:
        left = [f"{what} not taken ({errs[what]})" for what in ("padded_scales", "partial_n",
                                                                 "fp16") if errs[what] is not None]
        logger.info("FP8 prefill on %s: W8A8 on FP8 tensor cores for M >= %d (%s)%s", name,
                    W8A8_MIN_M, found.reason, "".join("; " + x for x in left))
    else:
        logger.info("FP8 prefill on %s: the weight-only Triton kernel (%s)", name, found.reason)
    return found


# (N, K, dtype) of weights whose W8A8 product scaled_mm refused at a size the probe did
# not try: they run the weight-only kernel from then on (logged once each)
_refused: set[tuple[int, int, torch.dtype]] = set()


def w8a8_or_weight_only(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fp8_linear_w8a8`, or the weight-only kernel for a weight whose product
    ``scaled_mm`` refused (an error raised at the call, as cuBLASLt's "no algorithm for
    this shape"): that weight shape is then remembered, logged once, and served by
    :func:`~elasticep.models.fp8_linear.fp8_linear_triton` for the rest of the process,
    so a case the probe did not cover costs speed, never a failed request.

    Args and Returns: as :func:`fp8_linear_w8a8`.
    """
    key = (*q.shape, x.dtype)
    if key not in _refused:
        try:
            return fp8_linear_w8a8(x, q, scale_inv, bias)
        except (RuntimeError, ValueError) as e:  # NotImplementedError is a RuntimeError
            _refused.add(key)
            logger.warning("FP8 prefill: scaled_mm refused [%d, %d] x [%d, %d]^T in %s (%s); "
                           "this weight shape runs the weight-only kernel from now on",
                           x.numel() // q.shape[1], q.shape[1], *q.shape, x.dtype,
                           str(e).strip().splitlines()[0][:200])
    return fp8_linear_triton(x, q, scale_inv, bias)


def fp8_project(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """An FP8 projection by :func:`choose_path`: the exact reference (CPU, other dtypes),
    the weight-only Triton kernel, or the W8A8 product (:func:`w8a8_or_weight_only`).

    Args and Returns: as :func:`~elasticep.models.fp8_linear.fp8_linear_reference`.
    """
    n, k = q.shape
    half = x.dtype if fp8_linear_ok(x) else None
    m = x.numel() // max(k, 1)
    support = blockwise_support(x.device) if half is not None and m >= W8A8_MIN_M else NOT_PROBED
    path = choose_path(m, n, k, half, support)
    if path == "w8a8":
        return w8a8_or_weight_only(x, q, scale_inv, bias)
    if path == "weight_only":
        return fp8_linear_triton(x, q, scale_inv, bias)
    return fp8_linear_reference(x, q, scale_inv, bias)
