"""The SwiGLU expert compute every executor shares: per-slot matmuls and grouped GEMM.

Rows arrive tagged with the local slot whose expert they need. On the CPU (and for
dtypes the fused kernel refuses) the rows are grouped by slot and each expert runs one
matmul pair, which reads the slot counts on the host. On CUDA with bf16,
:func:`grouped_swiglu` runs all slots as two grouped GEMMs (``torch._grouped_mm``, one
launch each, group offsets computed on the device): no host sync and no Python loop over
experts, so a layer's cost is reading the touched experts' weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elasticep.moe.experts import fp8_block, fp8_tiled
from elasticep.moe.experts.fp8_rows import fp8_rows_ok, swiglu_rows_fp8
from elasticep.moe.experts.fp8_sorted import swiglu_sorted_fp8
from elasticep.moe.experts.fp8_sorted import triton as _fp8_triton
from elasticep.moe.experts.small_batch_experts import small_batch_ok, swiglu_rows
from elasticep.moe.experts.sorted_experts import sorted_rows_ok, swiglu_sorted
from elasticep.moe.experts.tiled_experts import swiglu_tiled, tiled_rows_ok

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
FP8_KERNELS = _fp8_triton is not None  # the FP8 expert kernels are Triton


def swiglu_expert(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """One expert: ``w2 @ (silu(gate x) * (up x))``.

    Args:
        w13: ``[2*I, H]`` gate rows then up rows.
        w2: ``[H, I]``.
        x: ``[N, H]`` model dtype.
        out: ``[N, H]`` contiguous buffer for the result (else a new tensor).

    Returns:
        ``[N, H]`` model dtype.
    """
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    if out is None:
        return F.linear(F.silu(gate) * up, w2)
    return torch.mm(F.silu(gate) * up, w2.t(), out=out)  # the same GEMM F.linear runs


def run_expert_rows(w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor,
                    local_slots: torch.Tensor) -> torch.Tensor:
    """SiLU-gated MLP of each row's own slot, unweighted, by per-slot matmuls.

    The rows are sorted by slot once, each touched slot runs its matmul pair on its
    contiguous run of sorted rows (writing in place), and one scatter puts them back:
    four kernels a slot. Per-slot gathers and scatters were three more a slot, and on a
    shared CPU every extra small op can wait on an OpenMP barrier. Reads the slot counts
    on the host (a device sync on CUDA).

    Args:
        w13: [S, 2*I, H] gate rows then up rows.
        w2: [S, H, I].
        rows: [N, H] model dtype.
        local_slots: [N] int64 in [0, S).

    Returns:
        [N, H] model dtype: ``w2[s] @ (silu(gate_s x) * (up_s x))`` per row.
    """
    w13, w2 = dense_weights(w13, w2, rows.dtype)
    out = torch.empty_like(rows)
    if rows.shape[0] == 0:
        return out
    order = torch.argsort(local_slots, stable=True)
    counts = torch.bincount(local_slots, minlength=w13.shape[0]).tolist()
    x = rows.index_select(0, order)  # not rows[order]: several times faster on CPU
    y = torch.empty_like(x)
    start = 0
    for slot, n in enumerate(counts):
        if n:
            swiglu_expert(w13[slot], w2[slot], x[start:start + n], out=y[start:start + n])
        start += n
    return out.index_copy_(0, order, y)


def grouped_ok(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """True when :func:`grouped_swiglu` runs these inputs on the device with no host sync:
    ``torch._grouped_mm`` (CUDA bf16, 16-byte aligned rows), or packed FP8 slots
    (:mod:`elasticep.moe.experts.fp8_block`) on CUDA, which the FP8 kernels take."""
    if fp8_block.is_packed(w13):
        return x.is_cuda and FP8_KERNELS
    return (HAS_GROUPED_MM and x.is_cuda and x.dtype == torch.bfloat16
            and w13.dtype == torch.bfloat16 and x.shape[1] % 8 == 0 and w13.shape[1] % 16 == 0)


def dense_weights(w13: torch.Tensor, w2: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [S, 2I, H], w2 [S, H, I])`` as plain weights: packed FP8 slots are
    dequantized exactly into ``dtype`` (the torch reference path), others returned as
    they are."""
    if not fp8_block.is_packed(w13):
        return w13, w2
    inter, hidden = w2.shape[2], w13.shape[2]
    return (fp8_block.dequantize_packed(w13, 2 * inter, dtype),
            fp8_block.dequantize_packed(w2, hidden, dtype))


def _bounded_tags(tags: torch.Tensor, tag_bound: tuple[torch.Tensor, int]) -> torch.Tensor:
    # each row's tag cut to its block's bound (grouped_swiglu's ``tag_bound``), as a copy
    bound, block_rows = tag_bound
    return torch.minimum(tags.view(-1, block_rows), bound.reshape(-1, 1)).view(-1)


def _swiglu_fp8(w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor, tags: torch.Tensor,
                out: torch.Tensor | None, row_repeat: int) -> torch.Tensor:
    # packed FP8 slots on the device: prefill-sized batches on FP8 tensor cores (W8A8),
    # others with the weights dequantized in registers
    inter, hidden = w2.shape[2], w13.shape[2]
    q13, s13 = fp8_block.unpack(w13, 2 * inter)
    q2, s2 = fp8_block.unpack(w2, hidden)
    cap = torch.cuda.get_device_capability(rows.device)  # cached by torch: no sync
    if (fp8_tiled.w8a8_experts_ok(tags.shape[0], w13.shape[0], rows.dtype, cap,
                                  fp8_tiled.ENABLED) and rows.stride(1) == 1):
        return fp8_tiled.swiglu_tiled_fp8(q13, s13, q2, s2, rows, tags, out,
                                          row_repeat=row_repeat)
    if row_repeat > 1:
        rows = rows.unsqueeze(1).expand(-1, row_repeat, -1).reshape(-1, rows.shape[1])
    if fp8_rows_ok(rows, q13):
        return swiglu_rows_fp8(q13, s13, q2, s2, rows, tags.contiguous(), out)
    return swiglu_sorted_fp8(q13, s13, q2, s2, rows, tags, out)


# Above this many [S, N, max(2I, H)] intermediate elements the all-slots path of
# grouped_swiglu (sync_free without grouped GEMM) falls back to the per-slot loop.
ALL_SLOTS_MAX_ELEMENTS = 1 << 26


def all_slots_ok(w13: torch.Tensor, rows: torch.Tensor) -> bool:
    """True when :func:`grouped_swiglu`'s all-slots path fits its size bound."""
    S, two_i, H = w13.shape
    return S * rows.shape[0] * max(two_i, H) <= ALL_SLOTS_MAX_ELEMENTS


def grouped_swiglu(w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor,
                   tags: torch.Tensor, use_grouped: bool | None = None,
                   sync_free: bool = False, out: torch.Tensor | None = None,
                   row_repeat: int = 1,
                   tag_bound: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Unweighted SwiGLU expert output of each tagged row.

    Args:
        w13: [S, 2*I, H] gate rows then up rows (model dtype, rows' device), or packed
            FP8 slots (uint8, :mod:`elasticep.moe.experts.fp8_block`): on CUDA the FP8
            kernels read them (prefill-sized batches on an SM90 GPU the W8A8 ones of
            :mod:`~elasticep.moe.experts.fp8_tiled`, by its
            :func:`~elasticep.moe.experts.fp8_tiled.w8a8_experts_ok`; else
            :mod:`~elasticep.moe.experts.fp8_rows` up to their row bound,
            :mod:`~elasticep.moe.experts.fp8_sorted` above), elsewhere they are
            dequantized exactly and take the paths below.
        w2: [S, H, I], packed too when ``w13`` is.
        rows: [N, H] model dtype.
        tags: [N] int32/int64, ``local slot + 1``; 0 marks a padding row.
        use_grouped: force (True) or forbid (False) ``torch._grouped_mm``; None picks
            it where :func:`grouped_ok`. Unless False, on CUDA up to
            :data:`~elasticep.moe.experts.small_batch_experts.MAX_ROWS` rows take the per-row
            GEMV kernels of :mod:`elasticep.moe.experts.small_batch_experts`, more rows in
            bf16/fp16 the sorted-rows kernels of :mod:`elasticep.moe.experts.sorted_experts`
            (22-28 % faster than the grouped GEMM from 128 to 2048 rows at Qwen3-30B-A3B's
            expert shape, ``bench/expert_gemv.py``), and prefill-sized batches (from
            :data:`~elasticep.moe.experts.tiled_experts.MIN_ROWS_PER_SLOT` rows per slot) the
            tiled grouped GEMM of :mod:`elasticep.moe.experts.tiled_experts`, instead.
        sync_free: where grouped GEMM is not used, run every slot over every row
            (S batched matmul pairs, then pick each row's own slot) instead of the
            per-slot loop that reads slot counts on the host. S times the FLOPs, no
            sync, so it can run inside a CUDA graph; meant for small models in fp32
            (the demo), and taken only within :data:`ALL_SLOTS_MAX_ELEMENTS`.
        out: [N, H] buffer for the result (else a new tensor).
        row_repeat: ``rows`` is ``[N / row_repeat, H]`` and pair ``n`` reads row
            ``n // row_repeat`` (a token's top-k pairs share its row). The tiled kernels
            read it so; the other paths expand it first.
        tag_bound: ``(bound, block_rows)``, a ``[N / block_rows]`` (or ``[.., 1]``) int32 bound of
            each block's tags (the same-host exchange's
            :meth:`~elasticep.moe.exchange.ipc_exchange.IpcExchange.tag_cap`): the tags are read
            as ``min(tag, bound of the row's block)``. The per-row kernels apply it as
            they read a tag; the other paths clamp a copy first.

    Returns:
        [N, H] model dtype: ``w2[s] @ (silu(gate_s x) * (up_s x))`` for a row of slot
        ``s``, zeros for padding rows.
    """
    if fp8_block.is_packed(w13):
        if tag_bound is not None:
            tags = _bounded_tags(tags, tag_bound)
        if rows.is_cuda and use_grouped is not False and FP8_KERNELS:
            return _swiglu_fp8(w13, w2, rows, tags, out, row_repeat)
        if row_repeat > 1:
            rows = rows.unsqueeze(1).expand(-1, row_repeat, -1).reshape(-1, rows.shape[1])
        w13, w2 = dense_weights(w13, w2, rows.dtype)
        row_repeat, tag_bound = 1, None
    if tag_bound is not None:
        bound, block_rows = tag_bound
        if (row_repeat == 1 and use_grouped is not False and w2.is_contiguous()
                and small_batch_ok(rows, w13)):
            return swiglu_rows(w13, w2, rows, tags, out, tag_bound=(bound.reshape(-1),
                                                                    block_rows))
        tags = _bounded_tags(tags, tag_bound)
    if (row_repeat > 1 and use_grouped is not False and w2.is_contiguous()
            and tiled_rows_ok(rows, w13, w2, row_repeat)):
        return swiglu_tiled(w13, w2, rows, tags, out, row_repeat=row_repeat)
    if row_repeat > 1:
        rows = rows.unsqueeze(1).expand(-1, row_repeat, -1).reshape(-1, rows.shape[1])
    if use_grouped is not False and w2.is_contiguous():
        if small_batch_ok(rows, w13):
            return swiglu_rows(w13, w2, rows, tags, out)
        if tiled_rows_ok(rows, w13, w2):
            return swiglu_tiled(w13, w2, rows, tags, out)
        if sorted_rows_ok(rows, w13, w2):
            return swiglu_sorted(w13, w2, rows, tags, out)
    S = w13.shape[0]
    out = torch.zeros_like(rows) if out is None else out.zero_()
    if rows.shape[0] == 0:
        return out
    key = torch.where(tags > 0, tags.long() - 1, S)  # padding sorts after every slot
    if use_grouped is None:
        use_grouped = grouped_ok(rows, w13)
    if not use_grouped and sync_free and all_slots_ok(w13, rows):
        gate, up = torch.matmul(rows.unsqueeze(0), w13.transpose(1, 2)).chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))  # [S, N, H]
        pick = y[key.clamp(max=S - 1), torch.arange(rows.shape[0], device=rows.device)]
        out.copy_(torch.where((key < S).unsqueeze(1), pick, torch.zeros((), dtype=pick.dtype,
                                                                          device=pick.device)))
        return out
    if not use_grouped:
        valid = torch.nonzero(key < S).squeeze(1)  # host sync: fallback only
        out[valid] = run_expert_rows(w13, w2, rows[valid], key[valid])
        return out
    order = torch.argsort(key, stable=True)
    # bincount would read the largest key on the host; a scatter_add counts in place
    counts = torch.zeros(S + 1, dtype=torch.long, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offs = torch.cumsum(counts[:S], 0).to(torch.int32)  # end row of each slot's group
    x = rows[order]
    gate, up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    # Rows past the last offset (padding) are left undefined by the kernel.
    y = torch.where((key[order] < S).unsqueeze(1), y, torch.zeros((), dtype=y.dtype,
                                                                  device=y.device))
    out[order] = y
    return out

