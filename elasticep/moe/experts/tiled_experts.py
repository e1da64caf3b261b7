"""SwiGLU experts for prefill-sized batches: a tiled grouped GEMM over rows sorted by slot.

A prefill step of Qwen3-30B-A3B at 8192 tokens sends 65,536 (token, expert) rows through
each MoE layer, about 512 per expert. The sorted-rows kernels
(:mod:`elasticep.moe.experts.sorted_experts`) give one program a whole slot and walk its rows
serially, so at this size each program re-reads its weight block once per row tile and
most of the GPU waits on few long programs (measured: 318 of 407 ms of an 8192-token
step, ``bench/scale.py --only prefill``). Here the grid is the usual grouped-GEMM grid,
as in the Triton fused-MoE kernels of vLLM and SGLang: one program per (block of
``BLOCK_M`` rows of one slot, block of output features), so every row tile of every
slot runs in parallel and the K loop is software-pipelined.

The block -> slot map is built on the device from the per-slot counts (``cumsum`` and
``searchsorted`` over a grid sized for the worst case, ``ceil(N / BLOCK_M) + S``
blocks), so there is no host sync. Programs past the last block return at once.

Rounding follows the torch form (:func:`elasticep.moe.experts.expert_compute.swiglu_expert`):
gate and up rounded to the model dtype, SiLU rounded, their product rounded; the down
projection accumulates in float32 and rounds once.
"""

from __future__ import annotations

import torch

from elasticep.moe.experts.sorted_experts import slot_order

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; grouped_swiglu's paths serve them
    triton = None

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the gate/up kernel and of the down kernel.
# bench/tiled_experts.py on an H200 at Qwen3-30B-A3B's expert shape, 128 slots (2026-12-01):
# 128x128 tiles took 2.24 ms at 65,536 rows (2.7x the matmul bound; the sorted-rows kernels
# 6.72 ms), 1.30 ms at 16,384 (2.15) and 1.15 ms at 8,192 (1.40); at 2,048 rows the
# sorted-rows kernels win (0.63 ms against 0.78), hence MIN_ROWS_PER_SLOT.
GATE_UP_TILE = (128, 128, 64, 8, 3)
DOWN_TILE = (128, 128, 64, 8, 3)
# grouped_swiglu takes these kernels from this many rows per slot on (on average)
MIN_ROWS_PER_SLOT = 64


def tiled_rows_ok(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  row_repeat: int = 1) -> bool:
    """True when :func:`swiglu_tiled` takes these inputs and they are large enough for
    it to pay (CUDA, Triton, bf16/fp16, contiguous weights, unit column stride, at least
    :data:`MIN_ROWS_PER_SLOT` pairs per slot on average, ``rows.shape[0] * row_repeat``
    pairs in all)."""
    return (triton is not None and rows.is_cuda
            and rows.shape[0] * row_repeat >= MIN_ROWS_PER_SLOT * w13.shape[0]
            and rows.dtype in (torch.bfloat16, torch.float16) and rows.dtype == w13.dtype
            and w13.is_contiguous() and w2.is_contiguous() and rows.stride(1) == 1)


if triton is not None:
    from elasticep.moe.experts.sorted_experts import swiglu_store

    @triton.jit
    def _block_rows(order_ptr, block_slot_ptr, block_first_ptr, starts_ptr, counts_ptr, S,
                    BLOCK_M: tl.constexpr):
        # this program's slot (S: the padding rows, sorted after every slot), its rows'
        # positions in sorted order and original pair ids, which of them are real, and
        # whether the block holds any
        b = tl.program_id(1)
        s = tl.load(block_slot_ptr + b)
        s_ok = s <= S
        s = tl.where(s_ok, s, 0).to(tl.int64)
        m0 = (b - tl.load(block_first_ptr + s)) * BLOCK_M
        cnt = tl.where(s_ok, tl.load(counts_ptr + s), 0)
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < cnt
        pos = tl.load(starts_ptr + s) + m
        row = tl.load(order_ptr + pos, mask=m_ok, other=0).to(tl.int64)
        return s, pos, row, m_ok, s_ok & (m0 < cnt)

    @triton.jit
    def _tiled_gate_up_kernel(x_ptr, x_stride, order_ptr, block_slot_ptr, block_first_ptr,
                              starts_ptr, counts_ptr, w13_ptr, act_ptr, S, H, inter,
                              ROW_REPEAT: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        s, pos, row, m_ok, live = _block_rows(order_ptr, block_slot_ptr, block_first_ptr,
                                              starts_ptr, counts_ptr, S, BLOCK_M)
        src = row // ROW_REPEAT  # pair -> its token's row of x
        if live & (s < S):
            offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < inter
            base = w13_ptr + s * 2 * inter * H
            gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < H
                x = tl.load(x_ptr + src[:, None] * x_stride + offs_k[None, :],
                            mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w_mask = n_ok[None, :] & k_ok[:, None]
                wg = tl.load(base + offs_n[None, :] * H + offs_k[:, None], mask=w_mask,
                             other=0.0)
                wu = tl.load(base + (inter + offs_n[None, :]) * H + offs_k[:, None],
                             mask=w_mask, other=0.0)
                gate += tl.dot(x, wg)
                up += tl.dot(x, wu)
            swiglu_store(act_ptr + pos.to(tl.int64)[:, None] * inter + offs_n[None, :],
                         gate, up, m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def down_block(out_ptr, order_ptr, block_slot_ptr, block_first_ptr, starts_ptr,
                   counts_ptr, S, H, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A down kernel's program: :func:`_block_rows` and its output features
        ``offs_n`` (``n_ok`` inside H); a block of padding rows is written as zeros here,
        so the output needs no fill first."""
        s, pos, row, m_ok, live = _block_rows(order_ptr, block_slot_ptr, block_first_ptr,
                                              starts_ptr, counts_ptr, S, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        if live & (s == S):
            tl.store(out_ptr + row[:, None] * H + offs_n[None, :],
                     tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])
        return s, pos, row, m_ok, live, offs_n, n_ok

    @triton.jit
    def _tiled_down_kernel(act_ptr, order_ptr, block_slot_ptr, block_first_ptr, starts_ptr,
                           counts_ptr, w2_ptr, out_ptr, S, H, inter, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        s, pos, row, m_ok, live, offs_n, n_ok = down_block(
            out_ptr, order_ptr, block_slot_ptr, block_first_ptr, starts_ptr, counts_ptr, S, H,
            BLOCK_M, BLOCK_N)
        if live & (s < S):
            base = w2_ptr + s * H * inter
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < inter
                a = tl.load(act_ptr + pos.to(tl.int64)[:, None] * inter + offs_k[None, :],
                            mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(base + offs_n[None, :] * inter + offs_k[:, None],
                            mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                acc += tl.dot(a, w)
            tl.store(out_ptr + row[:, None] * H + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_layout(counts: torch.Tensor, n_rows: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Which slot each row block belongs to, computed on the device (no host sync).

    Args:
        counts: [S] int64, rows of each slot (on the rows' device).
        n_rows: N, the rows in all (padding included), an upper bound of ``counts.sum()``.
        block_m: rows per block.

    Returns:
        ``(block_slot, block_first, grid_blocks)``: ``block_slot`` [grid_blocks] int64,
        the slot of block b (S for a block past the last one); ``block_first`` [S]
        int64, the first block of each slot; ``grid_blocks`` = ``ceil(N / block_m) + S``,
        which bounds the real blocks since each slot wastes at most one partial block.
    """
    S = counts.shape[0]
    per_slot = (counts + block_m - 1) // block_m
    ends = torch.cumsum(per_slot, 0)
    grid_blocks = -(-n_rows // block_m) + S
    ids = torch.arange(grid_blocks, device=counts.device)
    block_slot = torch.searchsorted(ends, ids, right=True)
    return block_slot, ends - per_slot, grid_blocks


def sort_pairs(tags: torch.Tensor, slots: int, block_m: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                          int]:
    """The pairs sorted by slot and cut into row blocks on the device (no host sync): the
    launch layout of the tiled kernels here and in
    :mod:`elasticep.moe.experts.fp8_tiled`.

    Args:
        tags: [N] int32/int64, ``slot + 1``, 0 for a padding row.
        slots: S.
        block_m: rows per block.

    Returns:
        ``(order, starts, counts, block_slot, block_first, grid_blocks)``: ``order`` [N]
        the pair ids in slot order (padding last, as a slot S of its own, whose block
        group the down kernels fill with zeros); ``starts``, ``counts`` [S + 1] int64,
        each slot's first position in that order and its pairs; the rest as
        :func:`block_layout`.
    """
    order, starts, counts = slot_order(tags, slots)
    return (order, starts, counts, *block_layout(counts, tags.shape[0], block_m))


def swiglu_tiled(w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor, tags: torch.Tensor,
                 out: torch.Tensor | None = None,
                 gate_up_tile: tuple[int, int, int, int, int] | None = None,
                 down_tile: tuple[int, int, int, int, int] | None = None,
                 row_repeat: int = 1) -> torch.Tensor:
    """Unweighted SwiGLU of each row with its own slot's expert, as two grouped GEMMs.

    Args:
        w13: [S, 2*I, H] gate rows then up rows, contiguous, rows' dtype and device.
        w2: [S, H, I], contiguous.
        rows: [N / row_repeat, H] bf16/fp16 (:func:`tiled_rows_ok` without its size
            rule); any row stride (the exchange's tagged rows are read in place).
        tags: [N] int32/int64, ``slot + 1``, 0 for a padding row. Not range-checked (a
            check would sync): a tag above S reads out of bounds.
        out: [N, H] contiguous buffer for the result, or None.
        gate_up_tile, down_tile: ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)``
            (default :data:`GATE_UP_TILE`, :data:`DOWN_TILE`); both must share BLOCK_M.
        row_repeat: pair ``n`` reads row ``n // row_repeat`` (the top-k pairs of a
            token, ``row_repeat = k``, share its row: no ``[T*k, H]`` copy is made).

    Returns:
        [N, H] in the rows' dtype; zeros for padding rows (the down kernel writes them).

    Raises:
        ValueError: the two tiles differ in BLOCK_M, or ``tags`` is not ``row_repeat``
            pairs per row.
    """
    bm, bn, bk, wa, sa = gate_up_tile or GATE_UP_TILE
    bm2, bn2, bk2, wb, sb = down_tile or DOWN_TILE
    if bm != bm2:
        raise ValueError(f"gate/up and down tiles must share BLOCK_M, got {bm} and {bm2}")
    N, H = tags.shape[0], rows.shape[1]
    if N != rows.shape[0] * row_repeat:
        raise ValueError(f"{N} tags for {rows.shape[0]} rows of {row_repeat} pairs each")
    S, inter = w13.shape[0], w2.shape[2]
    out = rows.new_empty(N, H) if out is None else out
    if N == 0:
        return out
    order, starts, counts, block_slot, block_first, grid_blocks = sort_pairs(tags, S, bm)
    act = rows.new_empty(N, inter)
    # the output-feature blocks of one row block are neighbours in launch order, so its
    # rows come from HBM once and then from L2; row blocks first, the down kernel would
    # fetch the activations once per feature block (by arithmetic 16 x 100 MB a layer at
    # 65,536 pairs of Qwen3-30B-A3B, more than L2 holds)
    _tiled_gate_up_kernel[(triton.cdiv(inter, bn), grid_blocks)](
        rows, rows.stride(0), order, block_slot, block_first, starts, counts, w13, act,
        S, H, inter, ROW_REPEAT=row_repeat, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=wa, num_stages=sa)
    _tiled_down_kernel[(triton.cdiv(H, bn2), grid_blocks)](
        act, order, block_slot, block_first, starts, counts, w2, out, S, H, inter,
        BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2, num_warps=wb, num_stages=sb)
    return out
