"""SwiGLU experts for mid-sized and prefill batches, reading block-scaled FP8 weights.

The FP8 twin of :mod:`elasticep.moe.experts.sorted_experts`: rows sorted by slot on the
device (no host sync), a program owns one slot and one block of output features and
streams that expert's FP8 weights once. Each weight tile covers one 128-column scale
block: it is widened to the activation dtype (exact: every e4m3 value is a bf16 and an
fp16 value), multiplied on tensor cores with the rows, and the float32 partial product
is scaled by that block's scale, one multiply per output feature per block. So the
weights are dequantized in registers, never in memory.

Prefill is compute-bound, so DeepSeek-V3's recipe runs it as FP8 x FP8 tensor-core
matmuls with activations quantized per token per 128 columns. This kernel keeps the
activations in bf16 instead (the bf16 tensor-core rate): correct, and half the weight
bytes of bf16, but not the FP8 matmul rate.

Rounding follows the bf16 kernels: gate and up rounded to the activation dtype, SiLU,
the product rounded; the down projection accumulates in float32 and rounds once.
"""

from __future__ import annotations

import torch

from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_tiles import SORTED_KERNELS, Tile, launch_tiles
from elasticep.moe.experts.sorted_experts import slot_order, triton

if triton is not None:
    import triton.language as tl

    from elasticep.moe.experts.sorted_experts import (
        _slot_rows,
        down_tiles,
        gate_up_tiles,
        swiglu_store,
    )

    @triton.jit
    def _fp8_sorted_gate_up_kernel(x_ptr, x_stride, order_ptr, starts_ptr, counts_ptr,
                                   w13_ptr, w_slot, s13_ptr, s_slot, act_ptr, H, inter, s_cols,
                                   BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                                   CHUNK: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        cnt = tl.load(counts_ptr + s)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = offs_i < inter
        base = w13_ptr + s * w_slot
        sb = s13_ptr + s * s_slot
        s_gate = sb + (offs_i // CHUNK) * s_cols
        s_up = sb + ((inter + offs_i) // CHUNK) * s_cols
        dt = act_ptr.dtype.element_ty
        for m0 in range(0, cnt, BLOCK_M):
            pos, row, m_ok = _slot_rows(order_ptr, starts_ptr, counts_ptr, s, m0, BLOCK_M)
            gate = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
            for h0 in range(0, H, CHUNK):
                x, wg, wu = gate_up_tiles(x_ptr, x_stride, row, m_ok, base, offs_i, i_ok, h0,
                                          H, inter, CHUNK)
                c = h0 // CHUNK
                sg = tl.load(s_gate + c, mask=i_ok, other=0.0)
                su = tl.load(s_up + c, mask=i_ok, other=0.0)
                gate += tl.dot(x, tl.trans(wg.to(tl.float32).to(dt))) * sg[None, :]
                up += tl.dot(x, tl.trans(wu.to(tl.float32).to(dt))) * su[None, :]
            swiglu_store(act_ptr + pos.to(tl.int64)[:, None] * inter + offs_i[None, :],
                         gate, up, m_ok[:, None] & i_ok[None, :])

    @triton.jit
    def _fp8_sorted_down_kernel(act_ptr, order_ptr, starts_ptr, counts_ptr, w2_ptr, w_slot,
                                s2_ptr, s_slot, out_ptr, H, inter, s_cols,
                                BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr,
                                CHUNK: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        cnt = tl.load(counts_ptr + s)
        offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        o_ok = offs_o < H
        base = w2_ptr + s * w_slot
        s_row = s2_ptr + s * s_slot + (offs_o // CHUNK) * s_cols
        dt = act_ptr.dtype.element_ty
        for m0 in range(0, cnt, BLOCK_M):
            pos, row, m_ok = _slot_rows(order_ptr, starts_ptr, counts_ptr, s, m0, BLOCK_M)
            acc = tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.float32)
            for k0 in range(0, inter, CHUNK):
                a, w = down_tiles(act_ptr, pos, m_ok, base, offs_o, o_ok, k0, inter, CHUNK)
                sc = tl.load(s_row + k0 // CHUNK, mask=o_ok, other=0.0)
                acc += tl.dot(a, tl.trans(w.to(tl.float32).to(dt))) * sc[None, :]
            tl.store(out_ptr + row.to(tl.int64)[:, None] * H + offs_o[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & o_ok[None, :])


# The tiles (BLOCK_M and BLOCK_I of gate/up, BLOCK_M and BLOCK_O of down, warps,
# stages) come from fp8_tiles; the reduction chunk is one scale block.
_CHUNK = fp8_block.BLOCK[1]


def fp8_sorted_ok(rows: torch.Tensor, w13: torch.Tensor) -> bool:
    """True when :func:`swiglu_sorted_fp8` takes these inputs (Triton, bf16/fp16 rows
    on CUDA or under the interpreter, FP8 weights)."""
    return (triton is not None and rows.shape[0] > 0 and w13.dtype == fp8_block.FP8_DTYPE
            and (rows.dtype in (torch.bfloat16, torch.float16) or not rows.is_cuda))


def gate_up_sorted_fp8(w13: torch.Tensor, w13_scale: torch.Tensor, rows: torch.Tensor,
                       grouping: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                       act: torch.Tensor, tile: Tile) -> None:
    """The gate/up kernel of :func:`swiglu_sorted_fp8` alone: ``act [N, I]`` (in slot
    order, contiguous) gets the rows' SwiGLU intermediates, launched with ``tile``;
    ``grouping`` is
    :func:`~elasticep.moe.experts.sorted_experts.slot_order`'s result."""
    order, starts, counts = grouping
    H, inter, S = rows.shape[1], act.shape[1], w13.shape[0]
    _fp8_sorted_gate_up_kernel[(S, triton.cdiv(inter, tile.block))](
        rows, rows.stride(0), order, starts, counts, w13, w13.stride(0), w13_scale,
        w13_scale.stride(0), act, H, inter, w13_scale.shape[2], BLOCK_M=tile.block_m,
        BLOCK_I=tile.block, CHUNK=_CHUNK, **tile.launch_options())


def down_sorted_fp8(act: torch.Tensor, grouping: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    w2: torch.Tensor, w2_scale: torch.Tensor, out: torch.Tensor,
                    tile: Tile) -> None:
    """The down kernel of :func:`swiglu_sorted_fp8` alone: each row of ``out [N, H]``
    (contiguous) that is not padding gets its slot's ``w2 @ act``, launched with
    ``tile``."""
    order, starts, counts = grouping
    H, inter, S = out.shape[1], act.shape[1], w2.shape[0]
    _fp8_sorted_down_kernel[(S, triton.cdiv(H, tile.block))](
        act, order, starts, counts, w2, w2.stride(0), w2_scale, w2_scale.stride(0), out, H,
        inter, w2_scale.shape[2], BLOCK_M=tile.block_m, BLOCK_O=tile.block, CHUNK=_CHUNK,
        **tile.launch_options())


def swiglu_sorted_fp8(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, rows: torch.Tensor, tags: torch.Tensor,
                      out: torch.Tensor | None = None,
                      tiles: tuple[Tile, Tile] | None = None) -> torch.Tensor:
    """Unweighted SwiGLU of each row with its own slot's FP8 expert, rows grouped by slot.

    Args:
        w13, w13_scale, w2, w2_scale: as :func:`elasticep.moe.experts.fp8_rows.swiglu_rows_fp8`.
        rows: ``[N, H]`` activations, unit column stride, any row stride.
        tags: ``[N]`` int32/int64, ``slot + 1``, 0 for a padding row (not range-checked).
        out: ``[N, H]`` contiguous buffer for the result, or None.
        tiles: ``(gate/up, down)`` launch tiles; None picks them for the shape, the rows
            per slot and the device (:func:`~elasticep.moe.experts.fp8_tiles.launch_tiles`).

    Returns:
        ``[N, H]`` in the rows' dtype; zeros for padding rows.

    Raises:
        TileTableError: the device's shipped tile table is malformed.
    """
    N, H = rows.shape
    S, inter = w13.shape[0], w2.shape[2]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = rows.new_empty(N, H) if out is None else out
    out.zero_()  # padding rows are never written by the kernels
    grouping = slot_order(tags, S)
    act = rows.new_empty(N, inter)
    gu, dn = tiles or launch_tiles(SORTED_KERNELS, H, inter, N, S, rows.device)
    gate_up_sorted_fp8(w13, w13_scale, rows, grouping, act, gu)
    down_sorted_fp8(act, grouping, w2, w2_scale, out, dn)
    return out
