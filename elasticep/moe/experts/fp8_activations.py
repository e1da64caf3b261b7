"""Activations quantized to FP8 per token per 128 columns: the left operand of the
prefill matmuls on FP8 tensor cores, the dense projections'
(:mod:`elasticep.models.fp8_prefill`) and the experts'
(:mod:`elasticep.moe.experts.fp8_tiled`). It sits with the experts, the lower layer.

The recipe is the DeepSeek-V3 report's (section 3.3, "fine-grained quantization"): each
token's row ``x [K]`` is cut into groups of 128 columns, and each group gets its own
float32 scale ``s = amax(|group|) / 448`` (448 the largest finite float8_e4m3fn value)
and FP8 values ``q = x / s`` rounded to nearest e4m3 (ties to even), so ``x ~ q * s``.
The weights' 128 x 128 blocks (:mod:`elasticep.moe.experts.fp8_block`) and these
1 x 128 groups share the K step, so a product of one group by one block needs one scale
of each, applied to its float32 partial sum.

Error of one element: a value of a normal e4m3 magnitude moves by at most ``2^-4`` of
itself (3 mantissa bits, half a unit); below ``2^-6 * s`` e4m3 is subnormal and the
move is at most ``2^-10 * s``. A group of zeros takes the scale ``MIN_AMAX / 448``
(finite, never a division by zero) and stays zeros. A NaN or inf in a group makes that
group's scale and values NaN (nothing checks: this is the prefill hot path).

- :func:`quantize_activations_reference`: torch ops, any device (the reference of the
  tests and of the CPU W8A8 path).
- :func:`quantize_activations`: a Triton kernel (CUDA, bf16/fp16/float32 input) that
  reads the activations once and writes ``q`` and the scales in the layout
  ``torch.nn.functional.scaled_mm`` takes for ``ScalingType.BlockWise1x128`` (scales
  ``[M, K/128]`` with strides ``(1, M)``, i.e. token-major), with the rows padded to a
  multiple of ``row_multiple``. Bit-identical to the reference on the rows it shares.
"""

from __future__ import annotations

import torch

from elasticep.moe.experts import fp8_block

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton: the reference serves them
    triton = None

GROUP = 128  # columns per scale: the weights' K block
FP8_MAX = fp8_block.FP8_MAX
# Smallest group amax a scale is built from (the weights' rule): an all-zero group gets
# a tiny finite scale and quantizes to zeros.
MIN_AMAX = 1e-12
_ROWS_PER_PROGRAM = 32


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` quantized per row per 128 columns (the module's recipe).

    Args:
        x: ``[M, K]`` float activations (any float dtype, any device); K need not be a
            multiple of 128 (the last group is partial).

    Returns:
        ``(q, scale)``: ``q [M, K]`` float8_e4m3fn and ``scale [M, ceil(K/128)]``
        float32 (contiguous), on ``x``'s device; ``x ~ q * scale`` per group.

    Raises:
        ValueError: ``x`` is not a matrix.
    """
    if x.dim() != 2:
        raise ValueError(f"activations to quantize must be [M, K], got {list(x.shape)}")
    m, k = x.shape
    groups = -(-k // GROUP)
    xf = x.float()
    padded = torch.zeros(m, groups * GROUP, dtype=torch.float32, device=x.device)
    padded[:, :k] = xf
    amax = padded.view(m, groups, GROUP).abs().amax(dim=-1).clamp_min(MIN_AMAX)
    # a tensor divisor: CUDA divides by a Python number as a multiply by its reciprocal,
    # which differs from the division in the last bit for some amax (seen on an H100)
    scale = amax / torch.full_like(amax, FP8_MAX)
    each = scale.repeat_interleave(GROUP, dim=1)[:, :k]
    q = (xf / each).clamp(-FP8_MAX, FP8_MAX).to(fp8_block.FP8_DTYPE)
    return q, scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` per 128-column group, float32 ``[M, K]`` (one float32 rounding per
    element). ``scale`` is ``[M, ceil(K/128)]``, any strides."""
    k = q.shape[1]
    return q.float() * scale.float().repeat_interleave(GROUP, dim=1)[:, :k]


if triton is not None:

    @triton.jit
    def _round_to_e4m3(y):
        """``y`` (float32, ``|y| <= 448``) rounded to the nearest e4m3 value, ties to
        even, still float32: the cast after it is then exact, so the result does not
        depend on how a backend rounds its float8 conversion (the interpreter's carries
        wrongly across a power of two)."""
        bits = y.to(tl.int32, bitcast=True)
        # e4m3 keeps 3 fraction bits; below 2^-6 (subnormal) its values are 2^-9 apart
        exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
        ulp = ((exp - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
        v = y * ((257 - exp) << 23).to(tl.float32, bitcast=True)  # y / ulp, exact: |v| < 16
        r = (v + 12582912.0) - 12582912.0  # + 1.5 * 2^23 rounds to an integer, ties to even
        r = tl.abs(r * ulp)
        # a value rounded to zero keeps its sign (-0), as a float8 cast keeps it
        return tl.where(bits < 0, -r, r)

    @triton.jit
    def quantize_groups(x, ROWS: tl.constexpr, AMAX_MIN: tl.constexpr, QMAX: tl.constexpr):
        """``x [ROWS, GROUP]`` float32, a group per row (masked columns zero), quantized
        as :func:`quantize_activations_reference` does it: ``(q, scale)``, ``q`` the
        e4m3 values still in float32 (:func:`_round_to_e4m3`), ``scale [ROWS]``."""
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_MIN)
        # IEEE division (div_rn) in both places: the reference's torch ops round so
        scale = tl.math.div_rn(amax, tl.full([ROWS], QMAX, tl.float32))
        y = tl.math.div_rn(x, scale[:, None])
        return _round_to_e4m3(tl.minimum(tl.maximum(y, -QMAX), QMAX)), scale

    # M follows the prefill batch: one compiled kernel for every row count
    @triton.jit(do_not_specialize=["M", "M_pad"])
    def _quantize_kernel(x_ptr, x_stride, q_ptr, s_ptr, M, M_pad, K,
                         ROWS: tl.constexpr, GROUP_COLS: tl.constexpr, AMAX_MIN: tl.constexpr,
                         QMAX: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        group = tl.program_id(1)
        cols = group * GROUP_COLS + tl.arange(0, GROUP_COLS)
        col_ok = cols < K
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + cols[None, :],
                    mask=(rows < M)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        y, scale = quantize_groups(x, ROWS, AMAX_MIN, QMAX)
        pad_ok = rows < M_pad
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
                 y.to(q_ptr.dtype.element_ty), mask=pad_ok[:, None] & col_ok[None, :])
        # token-major scales: group g of row r at g * M_pad + r
        tl.store(s_ptr + group.to(tl.int64) * M_pad + rows, scale, mask=pad_ok)


def quantize_activations(x: torch.Tensor, row_multiple: int = 1
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_activations_reference` as one Triton kernel, in ``scaled_mm``'s
    layout (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

    Args:
        x: ``[M, K]`` bf16, fp16 or float32 activations, unit column stride.
        row_multiple: rows of the result are M rounded up to this; the extra rows are
            zeros with the zero-group scale (``MIN_AMAX / 448``).

    Returns:
        ``(q, scale)``: ``q [M_pad, K]`` float8_e4m3fn (contiguous) and ``scale
        [M_pad, ceil(K/128)]`` float32 with strides ``(1, M_pad)``; rows ``< M`` equal
        the reference's bit for bit.

    Raises:
        ValueError: ``x`` is not a matrix with unit column stride.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"activations to quantize must be [M, K] with unit column stride, "
                         f"got {list(x.shape)} strides {list(x.stride())}")
    m, k = x.shape
    m_pad = -(-m // row_multiple) * row_multiple
    groups = -(-k // GROUP)
    q = torch.empty(m_pad, k, dtype=fp8_block.FP8_DTYPE, device=x.device)
    scale_t = torch.empty(groups, m_pad, dtype=torch.float32, device=x.device)
    if m_pad:
        _quantize_kernel[(-(-m_pad // _ROWS_PER_PROGRAM), groups)](
            x, x.stride(0), q, scale_t, m, m_pad, k, ROWS=_ROWS_PER_PROGRAM,
            GROUP_COLS=GROUP, AMAX_MIN=MIN_AMAX, QMAX=FP8_MAX, num_warps=4)
    return q, scale_t.t()
