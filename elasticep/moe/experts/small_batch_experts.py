"""SwiGLU experts for a few rows: one matrix-vector product per (row, expert) pair.

At decode batch 1 a MoE layer of Qwen3-30B-A3B has 8 rows, each for its own expert.
The grouped GEMM (:func:`elasticep.moe.experts.expert_compute.grouped_swiglu`) then needs a
sort, a count, offsets and a scatter around two GEMMs whose tiles are mostly padding;
here two kernels read each row's slot from its tag and stream that expert's weights
once (memory-bound GEMV, the regime of decode): ``act = silu(gate x) * (up x)``, then
``y = w2 @ act``. Padding rows (tag 0) give zeros.

The rounding follows the torch form: gate and up are rounded to the model dtype, then
SiLU, then the product; the down projection accumulates in float32.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; grouped_swiglu's paths serve them
    triton = None

# Above this many rows the grouped GEMM wins: rows then share experts, and a GEMM reads
# each expert once for all of its rows.
MAX_ROWS = 64


def small_batch_ok(rows: torch.Tensor, w13: torch.Tensor) -> bool:
    """True when :func:`swiglu_rows` takes these inputs (CUDA, Triton, few rows)."""
    return (triton is not None and rows.is_cuda and 0 < rows.shape[0] <= MAX_ROWS
            and rows.dtype == w13.dtype and w13.is_contiguous())


if triton is not None:
    from elasticep.moe.experts.sorted_experts import swiglu_store

    @triton.jit
    def row_block(tag_ptr, tag_stride, bound_ptr, block_rows, w_ptr, n_out, expert_numel,
                   BLOCK: tl.constexpr, BOUNDED: tl.constexpr):
        # grid (row, output block): the row, the block's offsets and mask, where it is
        # live (a padding row, tag 0, loads nothing), and its expert's weights. BOUNDED:
        # the tag is first cut to its source block's bound (the exchange's received
        # tags, where a stopped or inactive peer's word must not become an index)
        r = tl.program_id(0).to(tl.int64)
        tag = tl.load(tag_ptr + r * tag_stride).to(tl.int64)
        if BOUNDED:
            tag = tl.minimum(tag, tl.load(bound_ptr + r // block_rows).to(tl.int64))
            tag = tl.maximum(tag, 0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_out
        live = mask & (offs * 0 + tag != 0)
        return r, tag != 0, offs, mask, live, w_ptr + tl.maximum(tag - 1, 0) * expert_numel

    @triton.jit(do_not_specialize=["block_rows"])  # one variant for every step's C
    def _gate_up_kernel(x_ptr, x_stride, tag_ptr, tag_stride, bound_ptr, block_rows, w13_ptr,
                        act_ptr, H, inter, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                        BOUNDED: tl.constexpr):
        r, real, offs_i, mask_i, live, base = row_block(tag_ptr, tag_stride, bound_ptr,
                                                         block_rows, w13_ptr, inter,
                                                         2 * inter * H, BLOCK_I, BOUNDED)
        gate = tl.zeros([BLOCK_I], dtype=tl.float32)
        up = tl.zeros([BLOCK_I], dtype=tl.float32)
        # a padding row skips the loop (its weights are masked anyway): at decode batch 1
        # on an EP transport half the rows are padding (the empty sources' blocks)
        for h0 in range(0, tl.where(real, H, 0), BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < H
            x = tl.load(x_ptr + r * x_stride + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            m = live[:, None] & mask_h[None, :]
            wg = tl.load(base + offs_i[:, None] * H + offs_h[None, :], mask=m, other=0.0)
            wu = tl.load(base + (inter + offs_i[:, None]) * H + offs_h[None, :], mask=m, other=0.0)
            gate += tl.sum(wg.to(tl.float32) * x[None, :], axis=1)
            up += tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
        swiglu_store(act_ptr + r * inter + offs_i, gate, up, mask_i)  # 0 where padding

    @triton.jit
    def down_row_block(act_ptr, r, real, offs_o, live, base, inter, BLOCK_O: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        """One output block of row ``r``'s down projection, float32 (zeros where the
        row is padding): ``w2[slot][offs_o] @ act[r]``. Shared by :func:`_down_kernel`
        and the exchange's fused down-and-send kernel."""
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        for k0 in range(0, tl.where(real, inter, 0), BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < inter
            a = tl.load(act_ptr + r * inter + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            w = tl.load(base + offs_o[:, None] * inter + offs_k[None, :],
                        mask=live[:, None] & mask_k[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        return acc

    @triton.jit(do_not_specialize=["block_rows"])
    def _down_kernel(act_ptr, tag_ptr, tag_stride, bound_ptr, block_rows, w2_ptr, out_ptr, H,
                     inter, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                     BOUNDED: tl.constexpr):
        r, real, offs_o, mask_o, live, base = row_block(tag_ptr, tag_stride, bound_ptr,
                                                        block_rows, w2_ptr, H, H * inter,
                                                        BLOCK_O, BOUNDED)
        acc = down_row_block(act_ptr, r, real, offs_o, live, base, inter, BLOCK_O, BLOCK_K)
        tl.store(out_ptr + r * H + offs_o, acc.to(out_ptr.dtype.element_ty), mask=mask_o)


# (BLOCK_I, BLOCK_H, warps) of the gate/up kernel and (BLOCK_O, BLOCK_K, warps) of the
# down kernel. bench/expert_gemv.py on an H200 at Qwen3-30B-A3B's expert shape
# (2026-12-01, docs/results/notes/gpu.md): the fastest of 40 pairs at 64 rows and within 1 %
# of the fastest at 8; 23 % (8 rows) and 10 % (64 rows) faster than (16, 256, 4) +
# (32, 128, 4).
GATE_UP_TILE = (8, 256, 4)
DOWN_TILE = (32, 256, 4)


def _bound_args(tags: torch.Tensor, tag_bound: tuple[torch.Tensor, int] | None
                ) -> tuple[torch.Tensor, int]:
    # the kernels' (bound pointer, rows per bound word); unbounded kernels read neither
    # (BOUNDED=False), so any tensor stands in for the pointer
    return tag_bound if tag_bound is not None else (tags, 1)


def swiglu_rows(w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor, tags: torch.Tensor,
                out: torch.Tensor | None = None, gate_up_tile: tuple[int, int, int] | None = None,
                down_tile: tuple[int, int, int] | None = None,
                tag_bound: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Unweighted SwiGLU of each row with its own slot's expert (two Triton kernels).

    Args:
        w13: [S, 2*I, H] gate rows then up rows, contiguous, rows' dtype and device.
        w2: [S, H, I], contiguous (both as the loaders allocate them).
        rows: [N, H] with ``N <= MAX_ROWS`` (:func:`small_batch_ok`); any row stride
            (the exchange's received rows are a strided view).
        tags: [N] int32/int64, ``slot + 1``, 0 for a padding row; any stride. Not
            range-checked (a check would sync): a tag above S reads out of bounds,
            unless ``tag_bound`` bounds it.
        out: [N, H] contiguous buffer for the result, or None.
        gate_up_tile, down_tile: block sizes and warps (default :data:`GATE_UP_TILE`,
            :data:`DOWN_TILE`).
        tag_bound: ``(bound, block_rows)``: row ``n``'s tag is read as
            ``clamp(tags[n], 0, bound[n // block_rows])``, where ``bound`` is a
            contiguous int32 tensor of ``ceil(N / block_rows)`` words (the same-host
            exchange's per-source bound, :meth:`~elasticep.moe.exchange.ipc_exchange.IpcExchange.tag_cap`:
            ``S`` for an active source, 0 for an inactive one). This is the exchange's
            tag clamp done in the kernels, not as a kernel of its own.

    Returns:
        [N, H] in the rows' dtype; zeros for padding rows.
    """
    N, H = rows.shape
    inter = w2.shape[2]
    act = rows.new_empty(N, inter)
    out = rows.new_empty(N, H) if out is None else out
    bo, bk, wb = down_tile or DOWN_TILE
    gate_up_rows(w13, rows, tags, act, gate_up_tile, tag_bound)
    bound, block_rows = _bound_args(tags, tag_bound)
    _down_kernel[(N, triton.cdiv(H, bo))](act, tags, tags.stride(0), bound, block_rows, w2, out,
                                          H, inter, BLOCK_O=bo, BLOCK_K=bk,
                                          BOUNDED=tag_bound is not None, num_warps=wb)
    return out


def gate_up_rows(w13: torch.Tensor, rows: torch.Tensor, tags: torch.Tensor, act: torch.Tensor,
                 gate_up_tile: tuple[int, int, int] | None = None,
                 tag_bound: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """The first half of :func:`swiglu_rows`: ``act = silu(gate x) * (up x)`` per row.

    Args:
        w13, rows, tags, gate_up_tile, tag_bound: as in :func:`swiglu_rows`.
        act: [N, I] contiguous, rows' dtype: written (zeros for padding rows).

    Returns:
        ``act``.
    """
    N, H = rows.shape
    inter = act.shape[1]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    bi, bh, wa = gate_up_tile or GATE_UP_TILE
    bound, block_rows = _bound_args(tags, tag_bound)
    # a stride-0 row (one token expanded to its k choices) is read in place
    _gate_up_kernel[(N, triton.cdiv(inter, bi))](rows, rows.stride(0), tags, tags.stride(0),
                                                 bound, block_rows, w13, act, H, inter,
                                                 BLOCK_I=bi, BLOCK_H=bh,
                                                 BOUNDED=tag_bound is not None, num_warps=wa)
    return act
