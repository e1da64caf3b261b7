"""SwiGLU experts for a few rows, reading block-scaled FP8 weights (the decode form).

The FP8 twin of :mod:`elasticep.moe.experts.small_batch_experts`: one matrix-vector
product per (row, expert) pair, for the decode regime where the step's time is the
bytes of expert weights it reads. Each expert's ``w13 [2I, H]`` and ``w2 [H, I]`` are
float8_e4m3fn with float32 block scales (:mod:`elasticep.moe.experts.fp8_block`, 128 x
128 blocks), so a row reads 1 byte per weight plus one scale per 16,384 weights, half of
bf16's bytes. The kernels dequantize in registers: each 128-column chunk of a weight row
is summed against the activation in float32, then multiplied by that block's scale
(one multiply per row per chunk, not per weight).

The rounding follows the bf16 kernels': gate and up are rounded to the activation dtype,
then SiLU, then the product; the down projection accumulates in float32.
:func:`swiglu_rows_fp8_reference` is the same computation in torch on exactly
dequantized weights; the two differ by float32 summation order only, which can move a
rounding to the activation dtype by one unit (see the GPU test for the bound used).
"""

from __future__ import annotations

import torch

from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_tiles import ROWS_KERNELS, Tile, launch_tiles

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton: the reference serves them
    triton = None

MAX_ROWS = 64
# The reduction chunk is one scale block (128 columns) so a chunk has one scale per row;
# the tiles (BLOCK_I of gate/up, BLOCK_O of down, warps, stages) come from
# fp8_tiles.
_CHUNK = fp8_block.BLOCK[1]


def fp8_rows_ok(rows: torch.Tensor, w13: torch.Tensor) -> bool:
    """True when :func:`swiglu_rows_fp8` takes these inputs (CUDA or the Triton
    interpreter, FP8 weights, few rows)."""
    return (triton is not None and 0 < rows.shape[0] <= MAX_ROWS
            and w13.dtype == fp8_block.FP8_DTYPE)


if triton is not None:
    from elasticep.moe.experts.sorted_experts import swiglu_store

    @triton.jit
    def _fp8_gate_up_kernel(x_ptr, x_stride, tag_ptr, w13_ptr, w_slot, s13_ptr, s_slot, act_ptr,
                            H, inter, s_cols, BLOCK_I: tl.constexpr, CHUNK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        tag = tl.load(tag_ptr + r).to(tl.int64)
        slot = tl.maximum(tag - 1, 0)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask_i = offs_i < inter
        live = mask_i & (offs_i * 0 + tag != 0)
        w = w13_ptr + slot * w_slot
        s = s13_ptr + slot * s_slot
        # the scale rows of this tile's gate and up rows (up starts at row `inter`,
        # which need not be a block boundary)
        s_gate = s + (offs_i // CHUNK) * s_cols
        s_up = s + ((inter + offs_i) // CHUNK) * s_cols
        gate = tl.zeros([BLOCK_I], dtype=tl.float32)
        up = tl.zeros([BLOCK_I], dtype=tl.float32)
        for h0 in range(0, tl.where(tag != 0, H, 0), CHUNK):
            offs_h = h0 + tl.arange(0, CHUNK)
            mask_h = offs_h < H
            x = tl.load(x_ptr + r * x_stride + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            m = live[:, None] & mask_h[None, :]
            wg = tl.load(w + offs_i[:, None] * H + offs_h[None, :], mask=m, other=0.0)
            wu = tl.load(w + (inter + offs_i[:, None]) * H + offs_h[None, :], mask=m, other=0.0)
            c = h0 // CHUNK
            sg = tl.load(s_gate + c, mask=live, other=0.0)
            su = tl.load(s_up + c, mask=live, other=0.0)
            gate += tl.sum(wg.to(tl.float32) * x[None, :], axis=1) * sg
            up += tl.sum(wu.to(tl.float32) * x[None, :], axis=1) * su
        swiglu_store(act_ptr + r * inter + offs_i, gate, up, mask_i)

    @triton.jit
    def _fp8_down_kernel(act_ptr, tag_ptr, w2_ptr, w_slot, s2_ptr, s_slot, out_ptr, H, inter,
                         s_cols, BLOCK_O: tl.constexpr, CHUNK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        tag = tl.load(tag_ptr + r).to(tl.int64)
        slot = tl.maximum(tag - 1, 0)
        offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        mask_o = offs_o < H
        live = mask_o & (offs_o * 0 + tag != 0)
        w = w2_ptr + slot * w_slot
        s_row = s2_ptr + slot * s_slot + (offs_o // CHUNK) * s_cols
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        for k0 in range(0, tl.where(tag != 0, inter, 0), CHUNK):
            offs_k = k0 + tl.arange(0, CHUNK)
            mask_k = offs_k < inter
            a = tl.load(act_ptr + r * inter + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            wt = tl.load(w + offs_o[:, None] * inter + offs_k[None, :],
                         mask=live[:, None] & mask_k[None, :], other=0.0)
            sc = tl.load(s_row + k0 // CHUNK, mask=live, other=0.0)
            acc += tl.sum(wt.to(tl.float32) * a[None, :], axis=1) * sc
        tl.store(out_ptr + r * H + offs_o, acc.to(out_ptr.dtype.element_ty), mask=mask_o)


def _check(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> None:
    for name, w, s in (("w13", w13, s13), ("w2", w2, s2)):
        if w.dtype != fp8_block.FP8_DTYPE:
            raise ValueError(f"{name} must be float8_e4m3fn, got {w.dtype}")
        want = fp8_block.scale_shape(w.shape)
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"{name}'s scales must be float32 {list(want)}, got "
                             f"{s.dtype} {list(s.shape)}")


def gate_up_rows_fp8(w13: torch.Tensor, w13_scale: torch.Tensor, rows: torch.Tensor,
                     tags: torch.Tensor, act: torch.Tensor, tile: Tile) -> None:
    """The gate/up kernel of :func:`swiglu_rows_fp8` alone: ``act [N, I]`` (contiguous,
    the rows' dtype) gets each row's SwiGLU intermediate, launched with ``tile``. Other
    args as :func:`swiglu_rows_fp8`'s (``rows`` with unit column stride)."""
    N, H = rows.shape
    inter = act.shape[1]
    _fp8_gate_up_kernel[(N, triton.cdiv(inter, tile.block))](
        rows, rows.stride(0), tags, w13, w13.stride(0), w13_scale, w13_scale.stride(0), act, H,
        inter, w13_scale.shape[2], BLOCK_I=tile.block, CHUNK=_CHUNK, **tile.launch_options())


def down_rows_fp8(act: torch.Tensor, tags: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, out: torch.Tensor, tile: Tile) -> None:
    """The down kernel of :func:`swiglu_rows_fp8` alone: ``out [N, H]`` (contiguous)
    gets ``w2 @ act`` of each row's slot, launched with ``tile``."""
    N, inter = act.shape
    H = out.shape[1]
    _fp8_down_kernel[(N, triton.cdiv(H, tile.block))](
        act, tags, w2, w2.stride(0), w2_scale, w2_scale.stride(0), out, H, inter,
        w2_scale.shape[2], BLOCK_O=tile.block, CHUNK=_CHUNK, **tile.launch_options())


def swiglu_rows_fp8(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                    w2_scale: torch.Tensor, rows: torch.Tensor, tags: torch.Tensor,
                    out: torch.Tensor | None = None,
                    tiles: tuple[Tile, Tile] | None = None) -> torch.Tensor:
    """Unweighted SwiGLU of each row with its own slot's FP8 expert (two Triton kernels).

    Args:
        w13: ``[S, 2I, H]`` float8_e4m3fn: gate rows then up rows; each slot contiguous,
            any slot stride (a packed slot's view, :func:`fp8_block.unpack`).
        w13_scale: ``[S, ceil(2I/128), ceil(H/128)]`` float32 block scales, each slot
            contiguous, any slot stride.
        w2: ``[S, H, I]`` float8_e4m3fn, as ``w13``.
        w2_scale: ``[S, ceil(H/128), ceil(I/128)]`` float32, as ``w13_scale``.
        rows: ``[N, H]`` bf16/fp16/fp32 activations, ``N <= MAX_ROWS``, unit column stride.
        tags: ``[N]`` contiguous int32/int64, ``slot + 1``, 0 for a padding row. Not
            range-checked (a check would sync the host): a tag above S reads out of bounds.
        out: ``[N, H]`` contiguous result buffer in the rows' dtype, or None.
        tiles: ``(gate/up, down)`` launch tiles; None picks them for the shape, the row
            count and the device (:func:`~elasticep.moe.experts.fp8_tiles.launch_tiles`).

    Returns:
        ``[N, H]`` in the rows' dtype; zeros for padding rows.

    Raises:
        ValueError: weights not FP8, or scales of the wrong shape or dtype.
        TileTableError: the device's shipped tile table is malformed.
    """
    _check(w13, w13_scale, w2, w2_scale)
    N, H = rows.shape
    inter = w2.shape[2]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    act = rows.new_empty(N, inter)
    out = rows.new_empty(N, H) if out is None else out
    gu, dn = tiles or launch_tiles(ROWS_KERNELS, H, inter, N, w13.shape[0], rows.device)
    gate_up_rows_fp8(w13, w13_scale, rows, tags, act, gu)
    down_rows_fp8(act, tags, w2, w2_scale, out, dn)
    return out


def swiglu_rows_fp8_reference(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                              w2_scale: torch.Tensor, rows: torch.Tensor,
                              tags: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu_rows_fp8` in torch, on any device: weights dequantized exactly to
    float32, products in float32, rounded to the rows' dtype where the kernels round.

    Args and Returns: as :func:`swiglu_rows_fp8`.

    Raises:
        ValueError: as :func:`swiglu_rows_fp8`.
    """
    _check(w13, w13_scale, w2, w2_scale)
    dt = rows.dtype
    inter = w2.shape[2]
    out = torch.zeros_like(rows)
    for n, tag in enumerate(tags.tolist()):
        if tag == 0:
            continue
        w_13 = fp8_block.dequantize(w13[tag - 1], w13_scale[tag - 1])
        w_2 = fp8_block.dequantize(w2[tag - 1], w2_scale[tag - 1])
        gu = w_13 @ rows[n].float()
        g, u = gu[:inter].to(dt).float(), gu[inter:].to(dt).float()
        act = ((g * torch.sigmoid(g)).to(dt).float() * u).to(dt)
        out[n] = (w_2 @ act.float()).to(dt)
    return out
