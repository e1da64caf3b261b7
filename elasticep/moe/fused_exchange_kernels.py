"""Kernels of the fused forms of the same-host exchange: each does in its send what a
separate kernel would do before or after it (the forms' owner is
:mod:`elasticep.moe.fused_exchange`).

* the static fused dispatch (:func:`fused_dispatch`): the gather of each pair's physical
  slot from the static dispatch map, the plan and the dispatch send, in one launch;
* the routed dispatch (:func:`routed_dispatch`): the same, for a one-token step whose
  softmax top-k routing runs in the kernel too
  (:func:`~elasticep.moe.softmax_topk.softmax_topk_row`);
* the down projection and combine send (:func:`down_combine_send`): the received rows'
  down projection (:func:`~elasticep.moe.experts.small_batch_experts.down_row_block`)
  stored straight into their sources' combine buffers.

They write the rows, tags and flags that the plain send kernels of
:mod:`elasticep.moe.exchange.ipc_kernels` write, with that module's device helpers for
the copies and the signals, so a step may mix the forms with the plain sends.
"""

from __future__ import annotations

import torch

from elasticep.moe.exchange import ipc_kernels as kernels
from elasticep.moe.softmax_topk import SoftmaxTopk

try:  # Triton is absent on CPU-only installs; these forms are then never taken
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

if triton is not None:
    from elasticep.moe.exchange.ipc_kernels import (
        _chunk_rows,
        _copy_rows,
        _release_own,
        _reset_prev,
        _send_program,
        _signal,
    )
    from elasticep.moe.experts.small_batch_experts import DOWN_TILE, down_row_block, row_block
    from elasticep.moe.softmax_topk import kernel_args, softmax_topk_row


if triton is not None:

    @triton.jit(do_not_specialize=["me", "C", "slot", "chunks", "split", "n_pairs"])
    def _fused_dispatch_kernel(hidden_ptr, stride_hidden, ids_ptr, map_ptr, position_ptr,
                               table_ptr, active_ptr, counter_ptr, my_flags_ptr, me, C, slot,
                               n_slots, chunks, split, top_k, S, n_pairs, logits_ptr, w_ptr, E,
                               scale, H: tl.constexpr, ROW_ELEMS: tl.constexpr,
                               ROW_WORDS: tl.constexpr, BLOCK_P: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_H: tl.constexpr, RESET_PREV: tl.constexpr,
                               ONE_BLOCK: tl.constexpr, ROUTE: tl.constexpr, K: tl.constexpr,
                               BLOCK_E: tl.constexpr, NORM: tl.constexpr,
                               ROUND_BF16: tl.constexpr, ROUND_F16: tl.constexpr):
        # The slot gather, the plan and the send of a decode-sized step in one launch.
        # Program (q, c) owns pairs [c*BLOCK_P, (c+1)*BLOCK_P): a pair's row in q's block
        # is the count of earlier pairs bound for q (plan_padded's order), which the
        # program reduces over all earlier pairs in wide vector blocks, then a cumsum
        # within its own. One serial scan over every pair per program (the first form)
        # took ~100 us a layer at 300 pairs; this is a reduction plus one block's copy.
        # The third grid axis splits the columns of the block's rows, so a one-token
        # step's copy runs on several SMs instead of one program's serial loop.
        q, c, part, h_lo, h_hi = _send_program(my_flags_ptr, me, n_slots, slot, split, H,
                                               BLOCK_H, RESET_PREV)
        alive = tl.load(active_ptr + q) != 0
        dest = tl.load(table_ptr + 3 * q).to(tl.pointer_type(hidden_ptr.dtype.element_ty))
        dest32 = tl.load(table_ptr + 3 * q).to(tl.pointer_type(tl.int32))
        first = c * BLOCK_P
        before = (q * 0).to(tl.int64)
        total = (q * 0).to(tl.int64)
        if not ONE_BLOCK:  # else every pair is in this program's block: no scan
            for n0 in range(0, n_pairs, BLOCK_N):
                j = n0 + tl.arange(0, BLOCK_N)
                mj = j < n_pairs
                dj = tl.load(map_ptr + tl.load(ids_ptr + j, mask=mj, other=0), mask=mj,
                             other=0) // S
                hj = (mj & (dj == q)).to(tl.int64)
                total += tl.sum(hj, 0)
                before += tl.sum(tl.where(j < first, hj, 0), 0)
        i = first + tl.arange(0, BLOCK_P)
        m = i < n_pairs
        if ROUTE:  # a one-token step routed here: its k pairs are lanes 0..k-1
            ids, w = softmax_topk_row(logits_ptr, E, scale, K, BLOCK_P, BLOCK_E, NORM,
                                      ROUND_BF16, ROUND_F16)
            if (q == 0) & (part == 0):
                tl.store(ids_ptr + i, ids.to(tl.int64), mask=m)
                tl.store(w_ptr + i, w, mask=m)
        else:
            ids = tl.load(ids_ptr + i, mask=m, other=0)
        phys = tl.load(map_ptr + ids, mask=m, other=0)
        hit = m & (phys // S == q)
        if ONE_BLOCK:
            total = tl.sum(hit.to(tl.int64), 0)
        within = before + tl.cumsum(hit.to(tl.int64), 0) - 1
        first_part = part == 0
        if first_part:
            tl.store(position_ptr + i, q * C + within, mask=hit)
        if alive:
            # one block's rows are loaded for every pair, so the loads do not wait for
            # the pairs' slots (the ids, then the map); only the stores are for this
            # destination's pairs
            tok = tl.where(m, i // top_k, 0).to(tl.int64)
            row = (me * C + within).to(tl.int64)
            _copy_rows(hidden_ptr, tok, stride_hidden, dest, row, ROW_ELEMS,
                       m if ONE_BLOCK else hit, hit, h_lo, h_hi, BLOCK_H)
            lo, hi = _chunk_rows(C, chunks, c)
            if first_part:
                tl.store(dest32 + row * ROW_WORDS + (ROW_WORDS - 1),
                         (phys - q * S + 1).to(tl.int32), mask=hit)
                for r0 in range(lo, hi, BLOCK_R):  # this program's share of unused rows: tag 0
                    r = r0 + tl.arange(0, BLOCK_R)
                    um = (r < hi) & (r >= total)
                    row = (me * C + r).to(tl.int64)
                    tl.store(dest32 + row * ROW_WORDS + (ROW_WORDS - 1),
                             tl.zeros_like(r).to(tl.int32), mask=um)
            _signal(table_ptr, counter_ptr, q, me, slot, n_slots, chunks * split)
        elif (c == 0) & first_part:
            _release_own(my_flags_ptr, q, n_slots, slot)

    @triton.jit(do_not_specialize=["me", "C", "slot"])
    def _down_combine_send_kernel(act_ptr, tag_ptr, tag_stride, bound_ptr, w2_ptr, table_ptr,
                                  active_ptr, counter_ptr, my_flags_ptr, me, C, slot, n_slots,
                                  H, inter, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                                  RESET_PREV: tl.constexpr):
        # program (row r, output block): the down projection of received row r, stored
        # straight into its source's combine buffer, where the combine send would copy it
        # from expert_out; then the source's flag, as the combine send sets it. Rows are
        # in blocks of C per source, so the programs of source q are C x the blocks.
        r = tl.program_id(0)
        ob = tl.program_id(1)
        q = r // C
        within = r - q * C
        _reset_prev(my_flags_ptr, q, me, n_slots, slot, within, ob, RESET_PREV)
        # The source's active word is read beside the row's tag and used only for the
        # store, so its load does not delay the weight loads (a branch around the
        # projection would wait for it first). An inactive source's rows are padding by
        # their bound, or after an abort, garbage that is projected but never sent.
        alive = tl.load(active_ptr + q) != 0
        dest = tl.load(table_ptr + 3 * q + 1).to(tl.pointer_type(act_ptr.dtype.element_ty))
        r64, real, offs_o, _, live, base = row_block(tag_ptr, tag_stride, bound_ptr, C,
                                                          w2_ptr, H, H * inter, BLOCK_O, True)
        acc = down_row_block(act_ptr, r64, real, offs_o, live, base, inter, BLOCK_O, BLOCK_K)
        if alive:
            row = (me * C + within).to(tl.int64)
            # only rows with a tag (``live``: in range and real), as the combine send
            tl.store(dest + row * H + offs_o, acc.to(act_ptr.dtype.element_ty), mask=live)
            _signal(table_ptr, counter_ptr, q, me, slot, n_slots, C * tl.num_programs(1))
        elif (within == 0) & (ob == 0):
            _release_own(my_flags_ptr, q, n_slots, slot)


FUSED_BLOCK_P = 16  # pairs per program of the fused static dispatch
# pairs a program scans at once for its rows' offsets: 0 picks the first of SCAN_BLOCKS
# that holds the step's pairs (a one-token step scans 16 lanes, not 1024); few widths,
# since each is a kernel variant compiled at start-up (IpcExchange.warm_kernels)
FUSED_BLOCK_N = 0
SCAN_BLOCKS = (16, 128, 1024)


def _scan_block(n_pairs: int) -> int:
    if FUSED_BLOCK_N:
        return FUSED_BLOCK_N
    return next((b for b in SCAN_BLOCKS if n_pairs <= b), SCAN_BLOCKS[-1])


def fused_dispatch_ok(hidden: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether :func:`fused_dispatch` takes this step (CUDA, decode-sized)."""
    return (triton is not None and hidden.is_cuda
            and topk_ids.numel() <= kernels.PLAN_MAX_PAIRS and hidden.stride(1) == 1)


def fused_dispatch(hidden: torch.Tensor, topk_ids: torch.Tensor, logical_to_physical: torch.Tensor,
                   slots_per_rank: int, me: int, C: int, row_elems: int, table: torch.Tensor,
                   active: torch.Tensor, counter: torch.Tensor, my_flags: torch.Tensor,
                   slot: int, reset_prev: bool = False) -> torch.Tensor:
    """Gather each pair's physical slot (``logical_to_physical[topk_ids]``, the static
    dispatch map of a layer), plan and send, in one kernel (CUDA,
    :func:`fused_dispatch_ok`). Writes what
    :func:`~elasticep.moe.exchange.ipc_kernels.dispatch_send` writes after
    :func:`~elasticep.moe.exchange.ipc_kernels.fused_plan`.

    Args:
        hidden: [T, H] model dtype; topk_ids: [T, k] int64 logical experts;
        logical_to_physical: [E] int64; the rest as
        :func:`~elasticep.moe.exchange.ipc_kernels.dispatch_send`.

    Returns:
        position: [T*k] int64, each pair's row in the ``[G*C]`` layout.
    """
    ids = topk_ids.reshape(-1).contiguous()
    position = torch.empty_like(ids)
    _launch_fused(hidden, ids, topk_ids.shape[1], position, logical_to_physical, slots_per_rank,
                  me, C, row_elems, table, active, counter, my_flags, slot, reset_prev)
    return position


def routed_dispatch_ok(hidden: torch.Tensor, logits: torch.Tensor, top_k: int) -> bool:
    """Whether :func:`routed_dispatch` takes this step: CUDA, one token, its k pairs in
    one program of the fused dispatch, E within one block of lanes."""
    return (triton is not None and hidden.is_cuda and hidden.shape[0] == 1
            and logits.shape[0] == 1 and top_k <= FUSED_BLOCK_P and logits.shape[1] <= 4096
            and logits.is_contiguous() and hidden.stride(1) == 1)


def routed_dispatch(hidden: torch.Tensor, logits: torch.Tensor, rule: SoftmaxTopk,
                    logical_to_physical: torch.Tensor, slots_per_rank: int, me: int, C: int,
                    row_elems: int, table: torch.Tensor, active: torch.Tensor,
                    counter: torch.Tensor, my_flags: torch.Tensor, slot: int,
                    reset_prev: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route a one-token step (the softmax top-k ``rule`` on its ``logits``) and send it as
    :func:`fused_dispatch` sends, in one kernel (CUDA, :func:`routed_dispatch_ok`): the
    router's own kernel (:func:`~elasticep.models.fused_routing.fused_softmax_topk`) is
    not launched. Both run :func:`~elasticep.moe.softmax_topk.softmax_topk_row`, so the
    experts, weights and rows are those of the two kernels in turn.

    Args:
        hidden: [1, H] model dtype; logits: [1, E] router logits (contiguous);
        rule: the layer's routing rule; the rest as :func:`fused_dispatch`.

    Returns:
        ``position`` [k] int64 (as :func:`fused_dispatch`), ``topk_ids`` [1, k] int64 and
        ``topk_weights`` [1, k] float32 (as the router's kernel returns them).
    """
    k = rule.top_k
    ids = torch.empty(1, k, dtype=torch.int64, device=hidden.device)
    weights = torch.empty(1, k, dtype=torch.float32, device=hidden.device)
    position = torch.empty(k, dtype=torch.int64, device=hidden.device)
    _launch_fused(hidden, ids.view(-1), k, position, logical_to_physical, slots_per_rank, me,
                  C, row_elems, table, active, counter, my_flags, slot, reset_prev,
                  route=(logits, weights, rule))
    return position, ids, weights


def _launch_fused(hidden: torch.Tensor, ids: torch.Tensor, top_k: int, position: torch.Tensor,
                  logical_to_physical: torch.Tensor, slots_per_rank: int, me: int, C: int,
                  row_elems: int, table: torch.Tensor, active: torch.Tensor,
                  counter: torch.Tensor, my_flags: torch.Tensor, slot: int, reset_prev: bool,
                  route: tuple[torch.Tensor, torch.Tensor, SoftmaxTopk] | None = None) -> None:
    G, n_slots = my_flags.shape
    chunks = max(1, -(-ids.numel() // FUSED_BLOCK_P))  # one program per block of pairs
    split = kernels.split_for(chunks, hidden.shape[1])
    if route is None:  # the routing constexprs are unused: one compiled form for all rules
        logits, weights, E, scale = ids, position, 1, 1.0
        rule_args = dict(K=1, BLOCK_E=1, NORM=False, ROUND_BF16=False, ROUND_F16=False)
    else:
        logits, weights, rule = route
        E, scale = logits.shape[1], float(rule.routed_scaling_factor)
        rule_args = kernel_args(rule, E, hidden.dtype)
    _fused_dispatch_kernel[(G, chunks, split)](
        hidden, hidden.stride(0), ids, logical_to_physical.contiguous(), position, table,
        active, counter, my_flags, me, C, slot, n_slots, chunks, split, top_k,
        slots_per_rank, ids.numel(), logits, weights, E, scale, H=hidden.shape[1],
        ROW_ELEMS=row_elems, ROW_WORDS=row_elems * hidden.element_size() // 4,
        BLOCK_P=FUSED_BLOCK_P, BLOCK_N=_scan_block(ids.numel()), BLOCK_R=kernels.BLOCK_R,
        BLOCK_H=kernels.BLOCK_H, RESET_PREV=reset_prev, ONE_BLOCK=chunks == 1,
        ROUTE=route is not None, num_warps=kernels.NUM_WARPS, **rule_args)


def down_combine_send(act: torch.Tensor, tags: torch.Tensor, bound: torch.Tensor,
                      w2: torch.Tensor, me: int, C: int, table: torch.Tensor,
                      active: torch.Tensor, counter: torch.Tensor, my_flags: torch.Tensor,
                      slot: int, reset_prev: bool = False) -> None:
    """The received rows' down projection and the combine send in one kernel (CUDA).

    What :func:`~elasticep.moe.experts.small_batch_experts.swiglu_rows`' second kernel and then
    :func:`~elasticep.moe.exchange.ipc_kernels.combine_send` do, without the
    ``expert_out`` rows in between: each row's output goes straight to its source's
    combine buffer, and each source is signalled as the combine send signals it.

    Args:
        act: [G*C, I] model dtype, contiguous: the rows' ``silu(gate x) * (up x)``
            (:func:`~elasticep.moe.experts.small_batch_experts.gate_up_rows`).
        tags: [G*C] int32 as received (any stride); bound: [G] int32, each source's
            tag bound (:meth:`~elasticep.moe.exchange.ipc_exchange.IpcExchange.tag_cap`): a tag is
            read as ``clamp(tag, 0, bound[source])``, and only rows with a tag left are
            sent.
        w2: [S, H, I] contiguous, the layer's down projections.
        me, C, table, active, counter, my_flags, slot, reset_prev: as in
            :func:`~elasticep.moe.exchange.ipc_kernels.combine_send` (``slot``: the
            combine's flag column).
    """
    G, n_slots = my_flags.shape
    N, inter = act.shape
    H = w2.shape[1]
    bo, bk, warps = DOWN_TILE
    _down_combine_send_kernel[(N, triton.cdiv(H, bo))](
        act, tags, tags.stride(0), bound, w2, table, active, counter, my_flags, me, C, slot,
        n_slots, H, inter, BLOCK_O=bo, BLOCK_K=bk, RESET_PREV=reset_prev, num_warps=warps)
