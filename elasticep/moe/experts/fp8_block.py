"""Block-scaled FP8 weights: the torch reference for quantizing and dequantizing them.

The format is the one DeepSeek-V3/R1 and the Qwen3 ``-FP8`` checkpoints ship (HF
``quantization_config`` ``{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128]}``): a linear weight ``W [out, in]`` is stored as
``float8_e4m3fn`` values ``Q`` beside ``scale_inv`` (float32, ``[ceil(out/128),
ceil(in/128)]``), and ``W = Q * scale_inv`` inside each 128 x 128 block. The last block
of a row or column may be partial.

Dequantization here is exact: every e4m3 value is a float32, and the product with a
float32 scale is one rounding in float32. So a model dequantized here on the CPU holds
the same float32 weights that any other exact dequantization would give, which is what
the CPU reference path and its comparison against transformers rely on.

Quantization follows the recipe of the DeepSeek-V3 report (section 3.3): per block,
``scale_inv = amax / 448`` (448 is the largest finite e4m3 value) and ``Q = W /
scale_inv`` rounded to nearest e4m3. The relative rounding error of a normal e4m3 value
is at most 2^-4 (3 mantissa bits); values below 2^-6 * scale_inv are subnormal and carry
an absolute error of at most 2^-10 * scale_inv.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = (128, 128)
# Smallest block amax a scale is built from: an all-zero block then stores zeros with a
# tiny, finite scale (never a division by zero, never a NaN).
_MIN_AMAX = 1e-12


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The ``scale_inv`` shape of a weight of ``shape`` (``[..., out, in]``):
    ``[..., ceil(out / block[0]), ceil(in / block[1])]``."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def expand_scales(scale_inv: torch.Tensor, shape: tuple[int, ...] | torch.Size,
                  block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """Each weight element's scale: ``scale_inv [..., R, C]`` repeated over its block and
    cut to ``shape [..., out, in]`` (float32)."""
    rows, cols = shape[-2], shape[-1]
    s = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return s.repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
               block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """``Q * scale_inv`` per block, in float32, then cast to ``dtype``.

    Args:
        q: ``[..., out, in]`` float8_e4m3fn weights.
        scale_inv: ``[..., ceil(out/b0), ceil(in/b1)]`` float32 block scales.
        dtype: the result's dtype.
        block: the block shape ``(b0, b1)``.

    Returns:
        ``[..., out, in]`` tensor of ``dtype`` on ``q``'s device.

    Raises:
        ValueError: ``q`` is not float8_e4m3fn, or ``scale_inv`` has the wrong shape.
    """
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"block-FP8 weights must be float8_e4m3fn, got {q.dtype}")
    want = scale_shape(q.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"block scales of a {list(q.shape)} weight must be {list(want)} "
                         f"for {block[0]}x{block[1]} blocks, got {list(scale_inv.shape)}")
    return (q.float() * expand_scales(scale_inv, q.shape, block)).to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., out, in]`` to block FP8 (DeepSeek-V3's recipe, see the module).

    Returns:
        ``(q, scale_inv)``: ``q [..., out, in]`` float8_e4m3fn and ``scale_inv [...,
        ceil(out/b0), ceil(in/b1)]`` float32, on ``w``'s device.

    Raises:
        ValueError: ``w`` has fewer than 2 dimensions or holds a non-finite value.
    """
    if w.dim() < 2:
        raise ValueError(f"block-FP8 quantizes matrices, got shape {list(w.shape)}")
    w = w.float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("cannot quantize a weight holding inf or NaN to FP8")
    *lead, rows, cols = w.shape
    r, c = scale_shape(w.shape, block)[-2:]
    padded = torch.zeros(*lead, r * block[0], c * block[1], dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w
    tiles = padded.unflatten(-1, (c, block[1])).unflatten(-3, (r, block[0]))  # [..., r, b0, c, b1]
    amax = tiles.abs().amax(dim=(-3, -1)).clamp_min(_MIN_AMAX)  # [..., r, c]
    scale_inv = amax / FP8_MAX
    q = (w / expand_scales(scale_inv, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv


def fake_quantize(w: torch.Tensor, dtype: torch.dtype | None = None,
                  block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """``dequantize(*quantize(w))``: the weight a block-FP8 copy of ``w`` stands for, in
    ``dtype`` (default ``w``'s)."""
    q, s = quantize(w, block)
    return dequantize(q, s, dtype or w.dtype, block)


# --- packed expert slots -----------------------------------------------------------------
#
# An expert slot of an FP8 model holds its weights and its block scales in one byte
# tensor: ``[S, R + extra, C]`` uint8, rows ``0..R-1`` the float8_e4m3fn weights and the
# ``extra`` rows after them the float32 scales' bytes (zero-padded). Every mover of
# expert slots (a peer copy over CUDA IPC, a collective, an orphan reload, a reserved
# empty slot) moves slot rows of a tensor whatever their bytes mean, so the scales travel
# with their weights by construction: no mover needs to know FP8 exists.


def packed_rows(rows: int, cols: int, block: tuple[int, int] = BLOCK) -> int:
    """Rows of a packed slot holding a ``[rows, cols]`` FP8 weight and its scales."""
    n_scales = scale_shape((rows, cols), block)
    return rows + -(-4 * n_scales[0] * n_scales[1] // cols)


def packable(rows: int, cols: int) -> bool:
    """Whether a ``[rows, cols]`` weight packs with its scales 4-byte aligned (the scale
    region of every slot then views as float32 in place)."""
    return rows % 4 == 0 and cols % 4 == 0


def is_packed(w: torch.Tensor | None) -> bool:
    """True for a packed FP8 slot tensor (uint8; unquantized slots are float)."""
    return w is not None and w.dtype == torch.uint8


def pack(q: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack ``q [..., R, C]`` float8_e4m3fn and ``scale_inv [..., r, c]`` float32 into
    ``[..., packed_rows(R, C), C]`` uint8 (into ``out`` if given).

    Raises:
        ValueError: ``q`` is not FP8, the scales have the wrong shape, or the weight does
            not pack (:func:`packable`).
    """
    R, C = q.shape[-2:]
    if q.dtype != FP8_DTYPE or tuple(scale_inv.shape) != scale_shape(q.shape):
        raise ValueError(f"pack needs float8_e4m3fn [..., R, C] and scales "
                         f"{list(scale_shape(q.shape))}, got {q.dtype} and "
                         f"{list(scale_inv.shape)}")
    if not packable(R, C):
        raise ValueError(f"a [{R}, {C}] FP8 weight does not pack (rows and columns must be "
                         "multiples of 4)")
    lead = q.shape[:-2]
    if out is None:
        out = torch.zeros(*lead, packed_rows(R, C), C, dtype=torch.uint8, device=q.device)
    out[..., :R, :] = q.view(torch.uint8)
    flat = scale_inv.float().reshape(*lead, -1).contiguous().view(torch.uint8)
    tail = out[..., R:, :].reshape(*lead, -1)
    tail[..., :flat.shape[-1]] = flat
    tail[..., flat.shape[-1]:] = 0
    out[..., R:, :] = tail.reshape(out[..., R:, :].shape)
    return out


def unpack(p: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a packed ``[S, R + extra, C]`` slot tensor: ``(q [S, R, C]``
    float8_e4m3fn, ``scale_inv [S, ceil(R/128), ceil(C/128)]`` float32), sharing its
    memory (no copy; the slot stride of both is the packed slot's)."""
    S, _, C = p.shape
    r, c = scale_shape((rows, C))
    q = p[:, :rows, :].view(FP8_DTYPE)
    tail = p[:, rows:, :]
    # the scale bytes of every slot start 4-byte aligned (packable), so the region views
    # as float32 in place: [S, extra * C / 4] with the packed slot stride
    s = torch.as_strided(tail, (S, tail.shape[1] * C), (p.stride(0), 1), tail.storage_offset())
    return q, s.view(torch.float32)[:, : r * c].unflatten(1, (r, c))


def dequantize_packed(p: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[S, rows, C]`` weights of a packed slot tensor, dequantized to ``dtype``."""
    q, s = unpack(p, rows)
    return dequantize(q, s, dtype)
