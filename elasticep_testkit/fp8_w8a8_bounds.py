"""Error bounds of the FP8 experts' prefill (:mod:`elasticep.moe.experts.fp8_tiled`),
derived from where the computations round, shared by its CPU and GPU tests and the
tile sweep (``bench/fp8_expert_prefill.py --sweep``).

Notation: ``unit = 2^-p`` is half an ulp at 1 of the activation dtype (a rounding to it
moves a value by at most ``unit`` of itself); a value rounded to nearest e4m3 within
its group of scale ``s`` moves by at most ``2^-4`` of itself (3 mantissa bits) or, if
subnormal, ``2^-10 s`` (``elasticep.moe.experts.fp8_activations``); SiLU's slope is at
most 1.0998 in magnitude. Two computations of one SwiGLU expert are compared; the
difference is carried step by step (first order plus the product of the gate and up
differences), every magnitude taken from a float32 evaluation:

1. gate and up before rounding differ by ``eg = |Wg| @ dx + acc * (|Wg| @ |x|)``: ``dx``
   how far the inputs differ, ``acc`` the summation's share (float32 order of K terms
   ``2 (K + 1) 2^-24``, plus the tensor cores' narrow K-step sum on the GPU);
2. each side rounds gate and up: ``dg = eg + unit (2 |G| + eg)``;
3. each side rounds SiLU: ``ds = 1.1 dg + unit (2 |silu(G)| + 1.1 dg)`` (plus the gate's
   rounding carried into SiLU's magnitude, and ``2^-20`` of it for two float32 SiLUs);
4. each side rounds the product: ``da = |s| du + |u| ds + ds du + unit (2 |s u| + ...)``;
5. a side that quantizes the intermediate moves it by ``2^-4 (|a| + da) + 2^-10 s_a``, with
   ``s_a`` bounded by the group's largest ``|a| + da`` over 448;
6. the down projection carries the intermediate's difference through ``|W2|``, adds its
   own summation share, and each side rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_activations import (
    FP8_MAX,
    GROUP,
    dequantize_activations,
    quantize_activations_reference,
)

SILU_SLOPE = 1.1  # max |silu'(x)| = 1.0998, at x near +-2.4
E4M3_REL = 2.0 ** -4  # a normal e4m3 rounding, relative
E4M3_SUB = 2.0 ** -10  # a subnormal e4m3 rounding, in units of the group scale
SILU_FLOAT32 = 2.0 ** -20  # two float32 evaluations of SiLU (each a few ulps off), apart


def float32_order(k: int) -> float:
    """Two float32 sums of the same ``k`` products in different orders differ by at
    most this fraction of the sum of the products' magnitudes."""
    return 2 * (k + 1) * 2.0 ** -24


def _group_max(v: torch.Tensor) -> torch.Tensor:
    """Each element's group (128 columns of its row) maximum, broadcast back."""
    n, k = v.shape
    groups = -(-k // GROUP)
    padded = F.pad(v, (0, groups * GROUP - k))
    return padded.view(n, groups, GROUP).amax(-1).repeat_interleave(GROUP, 1)[:, :k]


def _e4m3_move(mag: torch.Tensor) -> torch.Tensor:
    """How far quantizing per token per 128 columns moves values of magnitude at most
    ``mag`` [N, K] (step 5)."""
    return E4M3_REL * mag + E4M3_SUB * _group_max(mag) / FP8_MAX


def swiglu_difference(G: torch.Tensor, U: torch.Tensor, eg: torch.Tensor, eu: torch.Tensor,
                      unit: float) -> torch.Tensor:
    """Steps 2-4: a bound on how far two roundings of ``SiLU(G) * U`` (as the kernels
    round it) lie apart when their float32 ``G``, ``U`` differ by ``eg``, ``eu``."""
    dg = eg + unit * (2 * G.abs() + eg)
    du = eu + unit * (2 * U.abs() + eu)
    s = F.silu(G).abs() + SILU_SLOPE * unit * G.abs()
    # SiLU in float32 (exp and a division, or a sigmoid) is off by a few float32 ulps
    ds = SILU_SLOPE * dg + unit * (2 * s + SILU_SLOPE * dg) + SILU_FLOAT32 * s
    u = U.abs() * (1 + unit)
    first = s * (1 + unit) * du + u * ds + ds * du
    return first + unit * (2 * s * u + first)


def expert_bounds(w13, s13, w2, s2, rows, tags, row_repeat: int, *, x_rounded: bool,
                  acc: float, sides: int) -> dict[str, torch.Tensor]:
    """Per-element bounds of two SwiGLU expert computations on the same FP8 experts.

    Args:
        w13, s13, w2, s2, rows, tags, row_repeat: as ``swiglu_tiled_fp8``'s.
        x_rounded: one side quantizes the token rows, the other does not (the W8A8
            reference against the bf16-activation one); else both use the same
            quantized rows.
        acc: the summation's share of ``|W| @ |x|`` beyond the float32 order (0 for two
            float32 sums; the tensor cores' K-step sum on the GPU).
        sides: how many of the two quantize the intermediate (1 or 2).

    Returns:
        ``{"act": [N, I]`` bound of the (dequantized) intermediates' difference,
        ``"act_raw": [N, I]`` of the intermediates before their quantization,
        ``"act_mag": [N, I]`` the intermediate's magnitude, ``"out": [N, H]`` of the
        outputs' difference (tiny for padding rows)}, float32 on the rows' device.
    """
    unit = torch.finfo(rows.dtype).eps / 2
    x = rows.float()
    xq, xs = quantize_activations_reference(rows)
    if x_rounded:
        dx = _e4m3_move(x.abs()) + 2.0 ** -23 * x.abs()
    else:
        x, dx = dequantize_activations(xq, xs), torch.zeros_like(x)
    n, inter = tags.shape[0], w2.shape[2]
    tiny = torch.finfo(torch.float32).tiny
    out = {"act": torch.zeros(n, inter, device=rows.device),
           "act_raw": torch.zeros(n, inter, device=rows.device),
           "act_mag": torch.zeros(n, inter, device=rows.device),
           "out": torch.full((n, w2.shape[1]), tiny, device=rows.device)}
    for slot in torch.unique(tags[tags > 0]).tolist():
        idx = torch.nonzero(tags == slot).squeeze(1)
        w = fp8_block.dequantize(w13[slot - 1], s13[slot - 1])
        xi, dxi = x[idx // row_repeat], dx[idx // row_repeat]
        gu = xi @ w.T
        order = acc + float32_order(w.shape[1])
        e = dxi @ w.abs().T + order * (xi.abs() @ w.abs().T)
        da = swiglu_difference(gu[:, :inter], gu[:, inter:], e[:, :inter], e[:, inter:], unit)
        a = (F.silu(gu[:, :inter]) * gu[:, inter:]).abs()
        dq = da + sides * _e4m3_move(a + da)
        wd = fp8_block.dequantize(w2[slot - 1], s2[slot - 1]).abs()
        y = a @ wd.T
        dy = dq @ wd.T + (acc + float32_order(inter)) * ((a + dq) @ wd.T)
        out["act"][idx], out["act_raw"][idx], out["act_mag"][idx] = dq, da, a
        out["out"][idx] = dy + unit * (2 * y + dy) + tiny
    return out


def down_bound(act_deq: torch.Tensor, w2, s2, tags, acc: float,
               dtype: torch.dtype) -> torch.Tensor:
    """Per output element, how far a down projection of the same dequantized
    intermediate ``act_deq [N, I]`` (pair order) may land from the float32 reference's
    (step 6 with no input difference): ``[N, H]`` float32."""
    unit = torch.finfo(dtype).eps / 2
    tiny = torch.finfo(torch.float32).tiny
    bound = torch.full((tags.shape[0], w2.shape[1]), tiny, device=act_deq.device)
    for slot in torch.unique(tags[tags > 0]).tolist():
        idx = torch.nonzero(tags == slot).squeeze(1)
        wd = fp8_block.dequantize(w2[slot - 1], s2[slot - 1]).abs()
        mag = act_deq[idx].abs() @ wd.T
        dy = (acc + float32_order(w2.shape[2])) * mag
        bound[idx] = dy + unit * (2 * mag + dy) + tiny
    return bound


def unsort(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows kept in slot order (row ``p`` belongs to pair ``order[p]``) put back in pair
    order."""
    out = torch.empty_like(values)
    out[order] = values
    return out


def worst(diff: torch.Tensor, bound: torch.Tensor, live: torch.Tensor) -> float:
    """The largest ``|diff| / bound`` over the rows where ``live``."""
    return float((diff.float().abs() / bound)[live].max())
