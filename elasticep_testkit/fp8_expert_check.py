"""The check of the FP8 decode expert kernels against their torch reference, shared by
the CPU and GPU tests and the tile sweep (``bench/fp8_decode_sweep.py``): the rounding
bound a kernel's output must stay within, and the worst ratio to it."""

from __future__ import annotations

import torch

from elasticep.moe.experts import fp8_block


def rounding_bound(w13, s13, w2, s2, rows, tags) -> torch.Tensor:
    """Per output element, how far a kernel that rounds where the reference
    (``swiglu_rows_fp8_reference``) rounds may land from it in the rows' dtype.

    Each intermediate element may move by up to 4 units of that dtype (one each from
    gate, up, SiLU and the product, ``2^-p`` relative apiece, p the mantissa bits),
    which moves an output by ``4 * 2^-p * (|w2| @ |act|)``; the output's own rounding
    adds ``2^-p * |y|``. Float32 summation-order differences are far below these.

    Args:
        w13, s13, w2, s2, rows, tags: as ``swiglu_rows_fp8``'s (any device; the bound is
            computed there, a slot's weights dequantized once).

    Returns:
        ``[N, H]`` float32 on the rows' device; ``1e-6`` for padding rows (exact zeros).
    """
    unit = torch.finfo(rows.dtype).eps / 2  # half an ulp at 1: 2^-p relative
    inter = w2.shape[2]
    bound = torch.full(rows.shape, 1e-6, device=rows.device)
    for t in torch.unique(tags[tags > 0]).tolist():
        idx = torch.nonzero(tags == t).squeeze(1)
        w_13 = fp8_block.dequantize(w13[t - 1], s13[t - 1])
        w_2 = fp8_block.dequantize(w2[t - 1], s2[t - 1])
        gate, up = (rows[idx].float() @ w_13.T).split(inter, dim=1)
        act = torch.nn.functional.silu(gate) * up
        y = act @ w_2.T
        bound[idx] = 4 * unit * (act.abs() @ w_2.abs().T) + unit * y.abs() + 1e-6
    return bound


def worst_ratio(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> float:
    """The largest ``|got - ref| / bound`` (float32, on ``bound``'s device); NaN when
    any output is NaN, so a caller's ``<= 1`` check fails on it."""
    diff = (got.float().to(bound.device) - ref.float().to(bound.device)).abs()
    if bool(torch.isnan(diff).any()):
        return float("nan")
    return float((diff / bound).max())
