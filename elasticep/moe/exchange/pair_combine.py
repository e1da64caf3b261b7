"""The reduce that ends every combine: each token's k returned rows, weighted and summed.

As in DeepEP's ``combine(x, handle, topk_weights)``, the exchange's combine hands back
one row per token, not one per pair, so the weighted sum is the exchange's last step
(and the single-rank executor's, with no exchange before it).

:func:`combine_pairs` is the torch form: a gather (on the EP path, the pair rows come
back in the exchange's layout), a float32 cast, a multiply, a sum over k and a cast
back, four or five kernels per MoE layer that each move a few kilobytes at decode. On
CUDA :func:`fused_combine` does it in one Triton kernel. The products and the sum are in float32 like the
reference; the k terms are added in order, which torch's reduction may not do, so the
result can differ from it in the last bit.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; combine_pairs' torch form serves them
    triton = None


def fused_combine_ok(pair_out: torch.Tensor) -> bool:
    """True when :func:`fused_combine` takes ``pair_out`` (CUDA, Triton, unit column stride)."""
    return triton is not None and pair_out.is_cuda and pair_out.stride(-1) == 1


if triton is not None:

    @triton.jit
    def _combine_kernel(src_ptr, src_stride, rows_ptr, w_ptr, out_ptr, H,
                        K: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            if HAS_ROWS:
                r = tl.load(rows_ptr + t * K + j).to(tl.int64)
            else:
                r = t * K + j
            w = tl.load(w_ptr + t * K + j).to(tl.float32)
            x = tl.load(src_ptr + r * src_stride + offs, mask=mask, other=0.0).to(tl.float32)
            acc += x * w
        tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fused_combine(pair_out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * pair_out[rows[t*k + j]]`` in one kernel.

    Args:
        pair_out: [N, H] expert outputs, any dtype, unit column stride
            (:func:`fused_combine_ok`).
        weights: [T, k] combine weights (read as float32).
        dtype: the result dtype.
        rows: [T*k] int row of ``pair_out`` holding each (token, choice) pair's output,
            or None for row ``t*k + j`` (then N = T*k). Not range-checked.

    Returns:
        [T, H] in ``dtype``, summed in float32.
    """
    T, k = weights.shape
    H = pair_out.shape[1]
    out = torch.empty(T, H, dtype=dtype, device=pair_out.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block))](
        pair_out, pair_out.stride(0), rows if rows is not None else weights,
        weights.contiguous(), out, H, K=k, HAS_ROWS=rows is not None, BLOCK=block)
    return out


def combine_pairs(pair_out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum of each token's k expert outputs.

    On CUDA this is one kernel (:func:`fused_combine`); the torch form below is its
    reference.

    Args:
        pair_out: ``[T*k, H]``, row ``t*k + j`` is token t's j-th choice; or, with
            ``rows``, ``[N, H]`` holding pair ``i`` at row ``rows[i]``.
        weights: ``[T, k]`` float32 combine weights.
        dtype: the result dtype (the model's).
        rows: ``[T*k]`` int64 row of each flat pair, or None.

    Returns:
        ``[T, H]`` in ``dtype``, summed in float32.
    """
    if fused_combine_ok(pair_out):
        return fused_combine(pair_out, weights, dtype, rows)
    if rows is not None:
        pair_out = pair_out[rows]
    T, k = weights.shape
    out = (pair_out.view(T, k, pair_out.shape[-1]).float() * weights.float().unsqueeze(-1)).sum(1)
    return out.to(dtype)
