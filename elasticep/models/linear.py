"""A dense projection's weight, either a plain tensor of the model dtype or block FP8
(:class:`Fp8Weight`), and :func:`linear`, the matmul that takes both.

The model code holds its projections (attention, MLA, shared experts, dense MLPs) as
``Weight`` and calls :func:`linear` where it called ``F.linear``; an FP8 checkpoint's
projections then stay FP8 in memory, 1 byte a weight plus one float32 scale per
128 x 128 block, and are read at that size by :mod:`elasticep.models.fp8_linear` (decode
sizes) or multiplied on FP8 tensor cores by :mod:`elasticep.models.fp8_prefill` (prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from elasticep.models.fp8_linear import check_fp8_weight
from elasticep.models.fp8_prefill import fp8_project
from elasticep.moe.experts import fp8_block

_BLOCK_ROWS = fp8_block.BLOCK[0]


@dataclass(frozen=True)
class Fp8Weight:
    """A linear weight ``W [N, K]`` in block FP8: ``W = q * scale_inv`` per 128 x 128 block.

    Attributes:
        q: ``[N, K]`` float8_e4m3fn, unit column stride.
        scale_inv: ``[ceil(N/128), ceil(K/128)]`` float32, on ``q``'s device.

    Raises:
        ValueError: at construction, a weight or scales of the wrong dtype or shape.
    """

    q: torch.Tensor
    scale_inv: torch.Tensor

    def __post_init__(self) -> None:
        check_fp8_weight(self.q, self.scale_inv)

    @property
    def shape(self) -> torch.Size:
        """``[N, K]``, the weight's shape."""
        return self.q.shape

    @property
    def nbytes(self) -> int:
        """Bytes held: 1 a weight plus 4 a scale."""
        return self.q.numel() + 4 * self.scale_inv.numel()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``W`` as ``[N, K]`` of ``dtype`` (exact in float32)."""
        return fp8_block.dequantize(self.q, self.scale_inv, dtype)

    def split(self, sizes: list[int]) -> tuple[Fp8Weight, ...]:
        """Row ranges of ``sizes`` rows each, as views (no copy).

        Raises:
            ValueError: a range starts inside a 128-row scale block.
        """
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        if any(s % _BLOCK_ROWS for s in starts):
            raise ValueError(f"FP8 row ranges {sizes} must start on {_BLOCK_ROWS}-row blocks")
        return tuple(Fp8Weight(q, self.scale_inv[s // _BLOCK_ROWS: -(-(s + n) // _BLOCK_ROWS)])
                     for q, s, n in zip(self.q.split(sizes), starts, sizes, strict=True))

    def permute_rows(self, order: torch.Tensor) -> Fp8Weight:
        """Rows reordered, ``new[i] = old[order[i]]``, each keeping its scales.

        Raises:
            ValueError: a row would leave its 128-row scale block (its scales would not
                follow it).
        """
        if not rows_stay_in_blocks(order):
            raise ValueError("an FP8 row permutation must keep each row in its "
                             f"{_BLOCK_ROWS}-row scale block")
        q = self.q.view(torch.uint8)[order.to(self.q.device)].view(fp8_block.FP8_DTYPE)
        return Fp8Weight(q, self.scale_inv)


Weight = torch.Tensor | Fp8Weight


def rows_stay_in_blocks(order: torch.Tensor) -> bool:
    """Whether the row permutation ``order`` (``new[i] = old[order[i]]``) keeps every row
    in its 128-row scale block, so an FP8 weight can be permuted with its scales as
    they are (:meth:`Fp8Weight.permute_rows`)."""
    order = order.cpu()
    return torch.equal(order // _BLOCK_ROWS, torch.arange(order.numel()) // _BLOCK_ROWS)


def cat_rows(parts: list[Fp8Weight]) -> Fp8Weight | None:
    """The weights stacked by rows (one matmul for several projections of one input), or
    None when a part before the last has rows that end inside a scale block (its scales
    would not stack)."""
    if any(p.shape[0] % _BLOCK_ROWS for p in parts[:-1]):
        return None
    # concatenated as bytes: not every torch build concatenates float8 tensors
    q = torch.cat([p.q.view(torch.uint8) for p in parts]).view(fp8_block.FP8_DTYPE)
    return Fp8Weight(q, torch.cat([p.scale_inv for p in parts]))


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a plain or an FP8 weight.

    Args:
        x: ``[..., K]`` activations.
        w: ``[N, K]`` tensor (``F.linear``), or :class:`Fp8Weight`
            (:func:`~elasticep.models.fp8_prefill.fp8_project`: on CUDA the weight-only
            Triton kernel, or at prefill sizes the W8A8 product on FP8 tensor cores; the
            exact float32 reference elsewhere).
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    if isinstance(w, Fp8Weight):
        return fp8_project(x, w.q, w.scale_inv, bias)
    return F.linear(x, w, bias)


def dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """``w`` as a plain ``[N, K]`` tensor of ``dtype`` (an FP8 one dequantized)."""
    return w.dequantize(dtype) if isinstance(w, Fp8Weight) else w.to(dtype)


def weight_bytes(w: Weight | None) -> int:
    """Bytes ``w`` holds (0 for None)."""
    if w is None:
        return 0
    return w.nbytes if isinstance(w, Fp8Weight) else w.numel() * w.element_size()
