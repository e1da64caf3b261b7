"""SwiGLU experts for mid-sized batches: rows sorted by slot, each expert read once.

At decode batch 16 of Qwen3-30B-A3B a layer has 128 (token, expert) rows spread over
about 80 of its 128 experts: one to a few rows per expert. The per-row kernels
(:mod:`elasticep.moe.experts.small_batch_experts`) would read an expert once per row, and
``torch._grouped_mm`` runs GEMM tiles that are nearly all padding. Here the rows are
sorted by slot on the device (an argsort and a count, no host sync) and a program owns
one slot and one block of output features: it streams that expert's weights once and
multiplies them with the slot's rows, ``BLOCK_M`` at a time, on tensor cores. It is the
layout of vLLM's and SGLang's Triton fused-MoE kernels (tokens aligned per expert), in
its simplest form: no padding copy, the row indices are read through the sort order.

Rounding follows the torch form: gate and up rounded to the model dtype, SiLU, the
product rounded; the down projection accumulates in float32 and rounds once.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; grouped_swiglu's paths serve them
    triton = None


def slot_order(tags: torch.Tensor, slots: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (row, expert) pairs grouped by slot on the device, with no host sync.

    Args:
        tags: ``[N]`` int32/int64, ``slot + 1``, 0 for a padding pair.
        slots: S.

    Returns:
        ``(order, starts, counts)``: ``order`` ``[N]`` int64, the pair ids in slot order
        (a stable sort: pairs of one slot keep their order; padding last, as a slot S of
        its own); ``starts`` and ``counts`` ``[S + 1]`` int64, each slot's first position
        in that order and its pair count.
    """
    key = torch.where(tags > 0, tags.long() - 1, slots)  # padding sorts after every slot
    # a GPU radix sort takes a pass per key byte: 2 for int16 keys against 8 for int64
    # (the int64 sort was 27 us a layer at 512 pairs on an H100, 50 us at 65,536 on an
    # H200); the order is the same, as the sort is stable and the values equal
    order = torch.argsort(key.to(torch.int16) if slots < 2**15 - 1 else key, stable=True)
    counts = torch.zeros(slots + 1, dtype=torch.long, device=tags.device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # bincount would sync on its length
    return order, torch.cumsum(counts, 0) - counts, counts


def sorted_rows_ok(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """True when :func:`swiglu_sorted` takes these inputs (CUDA, Triton, bf16/fp16,
    contiguous weights, unit column stride)."""
    return (triton is not None and rows.is_cuda and rows.shape[0] > 0
            and rows.dtype in (torch.bfloat16, torch.float16) and rows.dtype == w13.dtype
            and w13.is_contiguous() and w2.is_contiguous() and rows.stride(1) == 1)


if triton is not None:

    @triton.jit
    def swiglu_round(gate, up, dt: tl.constexpr):
        """The SwiGLU of float32 ``gate`` and ``up`` rounded where the torch form rounds:
        each to ``dt``, SiLU of the rounded gate rounded again, and their product (in
        ``dt``)."""
        g = gate.to(dt).to(tl.float32)
        u = up.to(dt).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        return (silu * u).to(dt)

    @triton.jit
    def swiglu_store(ptrs, gate, up, mask):
        """The SwiGLU epilogue of every gate/up kernel (per row, sorted rows, tiled):
        :func:`swiglu_round` in the element type of ``ptrs``, stored there where
        ``mask``."""
        tl.store(ptrs, swiglu_round(gate, up, ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _slot_rows(order_ptr, starts_ptr, counts_ptr, s, m0, BLOCK_M: tl.constexpr):
        # the m0-th chunk of slot s's rows: positions in sorted order, original row ids
        start = tl.load(starts_ptr + s)
        cnt = tl.load(counts_ptr + s)
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < cnt
        pos = start + m
        row = tl.load(order_ptr + pos, mask=m_ok, other=0)
        return pos, row, m_ok

    @triton.jit
    def gate_up_tiles(x_ptr, x_stride, row, m_ok, base, offs_i, i_ok, h0, H, inter,
                       BLOCK_H: tl.constexpr):
        # the rows' x over columns [h0, h0 + BLOCK_H), and the gate and up weight tiles of
        # output features offs_i over them (of the expert at base); zeros where masked
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        x = tl.load(x_ptr + row.to(tl.int64)[:, None] * x_stride + offs_h[None, :],
                    mask=m_ok[:, None] & h_ok[None, :], other=0.0)
        w_mask = i_ok[:, None] & h_ok[None, :]
        wg = tl.load(base + offs_i[:, None] * H + offs_h[None, :], mask=w_mask, other=0.0)
        wu = tl.load(base + (inter + offs_i[:, None]) * H + offs_h[None, :], mask=w_mask,
                     other=0.0)
        return x, wg, wu

    @triton.jit
    def down_tiles(act_ptr, pos, m_ok, base, offs_o, o_ok, k0, inter, BLOCK_K: tl.constexpr):
        # the rows' activations over columns [k0, k0 + BLOCK_K), and the down weight tile
        # of output features offs_o over them (of the expert at base); zeros where masked
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        a = tl.load(act_ptr + pos.to(tl.int64)[:, None] * inter + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(base + offs_o[:, None] * inter + offs_k[None, :],
                    mask=o_ok[:, None] & k_ok[None, :], other=0.0)
        return a, w

    @triton.jit
    def _sorted_gate_up_kernel(x_ptr, x_stride, order_ptr, starts_ptr, counts_ptr, w13_ptr,
                               act_ptr, H, inter, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                               BLOCK_H: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        cnt = tl.load(counts_ptr + s)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = offs_i < inter
        base = w13_ptr + s * 2 * inter * H
        for m0 in range(0, cnt, BLOCK_M):
            pos, row, m_ok = _slot_rows(order_ptr, starts_ptr, counts_ptr, s, m0, BLOCK_M)
            gate = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                x, wg, wu = gate_up_tiles(x_ptr, x_stride, row, m_ok, base, offs_i, i_ok, h0,
                                          H, inter, BLOCK_H)
                gate += tl.dot(x, tl.trans(wg))
                up += tl.dot(x, tl.trans(wu))
            swiglu_store(act_ptr + pos.to(tl.int64)[:, None] * inter + offs_i[None, :],
                         gate, up, m_ok[:, None] & i_ok[None, :])

    @triton.jit
    def _sorted_down_kernel(act_ptr, order_ptr, starts_ptr, counts_ptr, w2_ptr, out_ptr, H,
                            inter, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        cnt = tl.load(counts_ptr + s)
        offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        o_ok = offs_o < H
        base = w2_ptr + s * H * inter
        for m0 in range(0, cnt, BLOCK_M):
            pos, row, m_ok = _slot_rows(order_ptr, starts_ptr, counts_ptr, s, m0, BLOCK_M)
            acc = tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                a, w = down_tiles(act_ptr, pos, m_ok, base, offs_o, o_ok, k0, inter, BLOCK_K)
                acc += tl.dot(a, tl.trans(w))
            tl.store(out_ptr + row.to(tl.int64)[:, None] * H + offs_o[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & o_ok[None, :])


# (BLOCK_M, BLOCK_I, BLOCK_H, warps) of gate/up and (BLOCK_M, BLOCK_O, BLOCK_K, warps) of
# down. bench/expert_gemv.py on an H200 at Qwen3-30B-A3B's expert shape (2026-12-01,
# docs/results/notes/gpu.md): 16-row tiles were the fastest of five from 128 to 512 rows over
# 128 experts (1-4 rows an expert); 32-row tiles won by 15 % at 2048 rows (16 an
# expert), hence DENSE_TILE from ROWS_PER_SLOT_DENSE rows per slot on.
GATE_UP_TILE = (16, 64, 128, 4)
DOWN_TILE = (16, 64, 128, 4)
DENSE_TILE = (32, 64, 128, 4)
ROWS_PER_SLOT_DENSE = 8


def swiglu_sorted(w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor, tags: torch.Tensor,
                  out: torch.Tensor | None = None,
                  gate_up_tile: tuple[int, int, int, int] | None = None,
                  down_tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Unweighted SwiGLU of each row with its own slot's expert, rows grouped by slot.

    Args:
        w13: [S, 2*I, H] gate rows then up rows, contiguous, rows' dtype and device.
        w2: [S, H, I], contiguous.
        rows: [N, H] bf16/fp16 (:func:`sorted_rows_ok`); any row stride.
        tags: [N] int32/int64, ``slot + 1``, 0 for a padding row. Not range-checked (a
            check would sync): a tag above S reads out of bounds.
        out: [N, H] contiguous buffer for the result, or None.
        gate_up_tile, down_tile: tile sizes and warps (default :data:`GATE_UP_TILE`,
            :data:`DOWN_TILE`; :data:`DENSE_TILE` for both from
            :data:`ROWS_PER_SLOT_DENSE` rows per slot).

    Returns:
        [N, H] in the rows' dtype; zeros for padding rows.
    """
    N, H = rows.shape
    S, inter = w13.shape[0], w2.shape[2]
    out = rows.new_empty(N, H) if out is None else out
    out.zero_()  # padding rows are never written by the kernels
    order, starts, counts = slot_order(tags, S)
    act = rows.new_empty(N, inter)
    dense = N >= ROWS_PER_SLOT_DENSE * S
    bm, bi, bh, wa = gate_up_tile or (DENSE_TILE if dense else GATE_UP_TILE)
    bm2, bo, bk, wb = down_tile or (DENSE_TILE if dense else DOWN_TILE)
    _sorted_gate_up_kernel[(S, triton.cdiv(inter, bi))](
        rows, rows.stride(0), order, starts, counts, w13, act, H, inter,
        BLOCK_M=bm, BLOCK_I=bi, BLOCK_H=bh, num_warps=wa)
    _sorted_down_kernel[(S, triton.cdiv(H, bo))](
        act, order, starts, counts, w2, out, H, inter, BLOCK_M=bm2, BLOCK_O=bo, BLOCK_K=bk,
        num_warps=wb)
    return out
