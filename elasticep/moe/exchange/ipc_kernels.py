"""Send kernels of the same-host expert exchange (:mod:`elasticep.moe.exchange.ipc_exchange`).

Each kernel writes this rank's rows straight into every active destination's receive
buffer, at this rank's own row block, then signals the destination. Grid
``(max_ep_size, chunks)``: program ``(q, c)`` moves chunk ``c`` of the rows bound for
rank ``q``; the last chunk to finish (a counter per destination) sets the flag
``flags_q[me, slot] = 1`` with a system-scope release, after a CTA barrier (Triton 3.6
emits a scalar atomic from one thread, so the barrier must order the row stores before
it). A destination whose ``active`` word is 0 is not written; program ``(q, 0)`` sets
this rank's own ``flags_me[q, slot]`` instead, so its wait on ``q`` passes and a
captured graph keeps running after ``q`` leaves, with no re-capture.

Destinations are read from a device pointer table ``[max_ep_size, 3]`` int64 (receive
buffer of the dispatch, of the combine, flag array), so a rejoin or a scale-up rewrites
the table and the graph stays valid.

Layout (C rows per source block, the step's capacity, the same on every rank):

* dispatch: destination ``q``'s receive buffer ``[G*C_max, W]`` gets, in rows
  ``me*C .. me*C + C``, the pairs this rank routes to ``q`` in
  :func:`~elasticep.moe.exchange.padded_exchange.plan_padded` order, each row the token's hidden
  state then its int32 tag (``local slot + 1``; 0 for the block's unused rows, whose
  values are left as they are);
* combine: rank ``q``'s combine buffer ``[G*C_max, H]`` gets, in rows
  ``me*C .. me*C + C``, this rank's expert outputs of the rows that ``q`` sent it (only
  rows with a non-zero tag).

The torch functions here are the reference the GPU tests compare the kernels with, and
the path CPU tests use (:class:`~elasticep.moe.exchange.ipc_exchange.IpcExchange` on CPU).
"""

from __future__ import annotations

import torch

from elasticep.moe.exchange.padded_exchange import split_rows
from elasticep.moe.softmax_topk import SoftmaxTopk

try:  # Triton is absent on CPU-only installs; the reference functions need none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None

if triton is not None:
    from elasticep.moe.experts.small_batch_experts import DOWN_TILE, down_row_block, row_block
    from elasticep.moe.softmax_topk import kernel_args, softmax_topk_row


def inverse_positions(position: torch.Tensor, rows: int) -> torch.Tensor:
    """Which flat pair each send row holds: ``[rows]`` int64, ``-1`` for unused rows.

    Args:
        position: [T*k] int64, each pair's row in the ``[G*C]`` send layout
            (:attr:`~elasticep.moe.exchange.padded_exchange.PaddedPlan.position`).
        rows: G*C.
    """
    inv = torch.full((rows,), -1, dtype=torch.int64, device=position.device)
    inv[position] = torch.arange(position.numel(), device=position.device)
    return inv


def dispatch_send_reference(hidden: torch.Tensor, inv: torch.Tensor, pair_tags: torch.Tensor,
                            top_k: int, me: int, C: int, dest_recv: list[torch.Tensor | None],
                            active: list[bool]) -> None:
    """Torch form of the dispatch send (rows and tags only; flags are the caller's).

    Args:
        hidden: [T, H] model dtype.
        inv: [G*C] int64 from :func:`inverse_positions`.
        pair_tags: [T*k] int32, ``local slot + 1`` of each pair on its destination.
        top_k: k; me: this rank; C: rows per source block.
        dest_recv: per rank, its dispatch receive buffer ``[G*C_max, W]`` (None: absent).
        active: per rank, whether it is written.
    """
    H = hidden.shape[1]
    for q, buf in enumerate(dest_recv):
        if buf is None or not active[q]:
            continue
        p = inv[q * C:(q + 1) * C]
        real = p >= 0
        rows, tags = split_rows(buf, H)
        block = slice(me * C, (me + 1) * C)
        rows[block][real] = hidden[p[real] // top_k]
        t = torch.zeros(C, dtype=torch.int32, device=buf.device)
        t[real] = pair_tags[p[real]]
        tags[block] = t


def combine_send_reference(expert_out: torch.Tensor, recv_tags: torch.Tensor, me: int, C: int,
                           dest_back: list[torch.Tensor | None], active: list[bool]) -> None:
    """Torch form of the combine send.

    Args:
        expert_out: [G*C, H] model dtype, this rank's output for the rows it received.
        recv_tags: [G*C] int32 tags of those rows (0: unused row, not sent).
        me, C: as in :func:`dispatch_send_reference`.
        dest_back: per rank, its combine receive buffer ``[G*C_max, H]``.
        active: per rank, whether it is written.
    """
    for q, buf in enumerate(dest_back):
        if buf is None or not active[q]:
            continue
        src = slice(q * C, (q + 1) * C)
        real = recv_tags[src] != 0
        buf[me * C:(me + 1) * C][real] = expert_out[src][real]


if triton is not None:

    @triton.jit(do_not_specialize=["n_pairs", "S", "C"])
    def _plan_kernel(slots_ptr, n_pairs, S, C, position_ptr, tag_ptr, inv_ptr,
                     G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr):
        # One program: plan_padded and inverse_positions in one launch (a decode layer
        # would otherwise pay a dozen small kernels for them). A pair's row within its
        # destination's block is the count of earlier pairs to that destination.
        for r0 in range(0, G * C, BLOCK_I):
            r = r0 + tl.arange(0, BLOCK_I)
            tl.store(inv_ptr + r, -1, mask=r < G * C)
        tl.debug_barrier()
        i = tl.arange(0, BLOCK_P)
        m = i < n_pairs
        slot = tl.load(slots_ptr + i, mask=m, other=0)
        dest = slot // S
        within = tl.zeros((BLOCK_P,), dtype=tl.int64)
        for g in tl.static_range(G):
            hit = m & (dest == g)
            within = tl.where(hit, tl.cumsum(hit.to(tl.int64), 0) - 1, within)
        pos = dest * C + within
        tl.store(position_ptr + i, pos, mask=m)
        tl.store(tag_ptr + i, (slot - dest * S + 1).to(tl.int32), mask=m)
        tl.store(inv_ptr + pos, i.to(tl.int64), mask=m)

    @triton.jit
    def _chunk_rows(C, chunks, c):
        # rows [lo, hi) of a destination's C that program c of ``chunks`` moves
        per = tl.cdiv(C, chunks)
        lo = c * per
        return lo, tl.minimum(lo + per, C)

    @triton.jit
    def _col_range(H, split, part, BLOCK_H: tl.constexpr):
        # columns [lo, hi) of a row that part ``part`` of ``split`` copies (whole
        # BLOCK_H blocks, so the parts' loads stay aligned)
        per = tl.cdiv(tl.cdiv(H, split), BLOCK_H) * BLOCK_H
        lo = part * per
        return lo, tl.minimum(lo + per, H)

    @triton.jit
    def _copy_rows(src_ptr, src_row, src_stride, dst_ptr, dst_row, dst_stride, load_mask,
                   mask, h_lo, h_hi, BLOCK_H: tl.constexpr):
        # rows src_row -> dst_row (int64 [BLOCK_R] each), columns [h_lo, h_hi): loaded
        # where ``load_mask``, stored where ``mask`` (a subset of it)
        for h0 in range(h_lo, h_hi, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            in_cols = (h < h_hi)[None, :]
            v = tl.load(src_ptr + src_row[:, None] * src_stride + h[None, :],
                        mask=load_mask[:, None] & in_cols)
            tl.store(dst_ptr + dst_row[:, None] * dst_stride + h[None, :], v,
                     mask=mask[:, None] & in_cols)

    @triton.jit
    def _release_own(my_flags_ptr, q, n_slots, slot):
        # An inactive destination: pass this rank's own wait on it. A plain store: that
        # wait runs on this rank's stream after this kernel has ended, which makes the
        # store visible, and no rows are published with it (a system-scope release here
        # was the one fence of a one-rank step's send).
        tl.store(my_flags_ptr + q * n_slots + slot, 1)

    @triton.jit
    def _reset_prev(my_flags_ptr, q, me, n_slots, slot, c, part, RESET_PREV: tl.constexpr):
        # The flag of the exchange before this one (waited already, still 1) goes back
        # to 0 here instead of in a stream write after the wait: one graph node less per
        # exchange. Program (q, 0, 0) clears q's flag before it takes part in signalling
        # q, so the clear happens-before q's next write of that flag, which q makes only
        # after this exchange's signal reaches it.
        if RESET_PREV:
            if (c == 0) & (part == 0) & (q != me):
                tl.store(my_flags_ptr + q * n_slots + (slot + n_slots - 1) % n_slots, 0)

    @triton.jit
    def _signal(table_ptr, counter_ptr, q, me, slot, n_slots, chunks):
        # the caller's row stores must be visible before the flag: a CTA barrier, an
        # acq_rel count of finished chunks, and a system-scope release by the last one
        tl.debug_barrier()
        if q != me:
            done = tl.atomic_add(counter_ptr + q, 1, sem="acq_rel", scope="sys")
            if done == chunks - 1:
                tl.store(counter_ptr + q, 0)
                flags = tl.load(table_ptr + 3 * q + 2).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(flags + me * n_slots + slot, 1, sem="release", scope="sys")

    @triton.jit(do_not_specialize=["me", "C", "slot", "chunks", "split"])
    def _dispatch_send_kernel(hidden_ptr, stride_hidden, inv_ptr, tag_ptr, table_ptr,
                              active_ptr, counter_ptr, my_flags_ptr, me, C, slot, n_slots,
                              chunks, split, top_k, H: tl.constexpr, ROW_ELEMS: tl.constexpr,
                              ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_H: tl.constexpr, RESET_PREV: tl.constexpr):
        # program (q, c, part): rows of chunk c bound for q, columns of part ``part``
        q = tl.program_id(0)
        c = tl.program_id(1)
        part = tl.program_id(2)
        _reset_prev(my_flags_ptr, q, me, n_slots, slot, c, part, RESET_PREV)
        h_lo, h_hi = _col_range(H, split, part, BLOCK_H)
        if tl.load(active_ptr + q) != 0:
            dest = tl.load(table_ptr + 3 * q).to(tl.pointer_type(hidden_ptr.dtype.element_ty))
            dest32 = tl.load(table_ptr + 3 * q).to(tl.pointer_type(tl.int32))
            lo, hi = _chunk_rows(C, chunks, c)
            for r0 in range(lo, hi, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                rm = r < hi
                p = tl.load(inv_ptr + q * C + r, mask=rm, other=-1)
                real = rm & (p >= 0)
                tok = tl.where(real, p // top_k, 0).to(tl.int64)
                tag = tl.load(tag_ptr + tl.where(real, p, 0), mask=real, other=0)
                row = (me * C + r).to(tl.int64)
                _copy_rows(hidden_ptr, tok, stride_hidden, dest, row, ROW_ELEMS, real, real,
                           h_lo, h_hi, BLOCK_H)
                if part == 0:
                    tl.store(dest32 + row * ROW_WORDS + (ROW_WORDS - 1), tag.to(tl.int32),
                             mask=rm)
            _signal(table_ptr, counter_ptr, q, me, slot, n_slots, chunks * split)
        elif (c == 0) & (part == 0):
            _release_own(my_flags_ptr, q, n_slots, slot)

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
        q = tl.program_id(0)
        c = tl.program_id(1)
        part = tl.program_id(2)
        _reset_prev(my_flags_ptr, q, me, n_slots, slot, c, part, RESET_PREV)
        h_lo, h_hi = _col_range(H, split, part, BLOCK_H)
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

    @triton.jit(do_not_specialize=["me", "C", "slot", "chunks", "split"])
    def _combine_send_kernel(out_ptr, recv32_ptr, table_ptr, active_ptr, counter_ptr,
                             my_flags_ptr, me, C, slot, n_slots, chunks, split, H: tl.constexpr,
                             ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_H: tl.constexpr, RESET_PREV: tl.constexpr):
        q = tl.program_id(0)
        c = tl.program_id(1)
        part = tl.program_id(2)
        _reset_prev(my_flags_ptr, q, me, n_slots, slot, c, part, RESET_PREV)
        h_lo, h_hi = _col_range(H, split, part, BLOCK_H)
        if tl.load(active_ptr + q) != 0:
            dest = tl.load(table_ptr + 3 * q + 1).to(tl.pointer_type(out_ptr.dtype.element_ty))
            lo, hi = _chunk_rows(C, chunks, c)
            for r0 in range(lo, hi, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                rm = r < hi
                src = (q * C + r).to(tl.int64)
                tag = tl.load(recv32_ptr + src * ROW_WORDS + (ROW_WORDS - 1), mask=rm, other=0)
                real = rm & (tag != 0)
                row = (me * C + r).to(tl.int64)
                _copy_rows(out_ptr, src, H, dest, row, H, real, real, h_lo, h_hi, BLOCK_H)
            _signal(table_ptr, counter_ptr, q, me, slot, n_slots, chunks * split)
        elif (c == 0) & (part == 0):
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


BLOCK_R = 16
BLOCK_H = 256  # columns a program copies per iteration
NUM_WARPS = 4  # of each send kernel's programs (Triton's default)
PLAN_MAX_PAIRS = 2048  # one program's pairs (a 256-sequence decode step at top-8)


def plan_ok(slots: torch.Tensor) -> bool:
    """Whether :func:`fused_plan` takes these ``[T, k]`` slots (CUDA, few enough pairs)."""
    return triton is not None and slots.is_cuda and slots.numel() <= PLAN_MAX_PAIRS


def fused_plan(slots: torch.Tensor, slots_per_rank: int, group_size: int, capacity: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~elasticep.moe.exchange.padded_exchange.plan_padded` and :func:`inverse_positions`
    in one kernel (CUDA, :func:`plan_ok`): ``(position [T*k] int64, tag [T*k] int32,
    inv [G*C] int64)``, equal to theirs."""
    flat = slots.reshape(-1).contiguous()
    n = flat.numel()
    position = torch.empty(n, dtype=torch.int64, device=flat.device)
    tag = torch.empty(n, dtype=torch.int32, device=flat.device)
    inv = torch.empty(group_size * capacity, dtype=torch.int64, device=flat.device)
    _plan_kernel[(1,)](flat, n, slots_per_rank, capacity, position, tag, inv, G=group_size,
                       BLOCK_P=PLAN_MAX_PAIRS, BLOCK_I=1024)
    return position, tag, inv
MAX_CHUNKS = 256  # programs per destination: a prefill's rows spread over every SM


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


SPLIT_PROGRAMS = 128  # programs per destination that a small step's column split aims at


def split_for(chunks: int, H: int) -> int:
    """Column parts per row block: enough that ``chunks * parts`` programs reach
    :data:`SPLIT_PROGRAMS` for a small step (at most one ``BLOCK_H`` block a part),
    1 for a step that already has that many chunks. One program copying a one-token
    step's rows column block after column block took 11 us a layer on the H200."""
    return max(1, min(-(-H // BLOCK_H), SPLIT_PROGRAMS // chunks))


def chunks_for(C: int) -> int:
    """Programs per destination for ``C`` rows per block: one per ``BLOCK_R`` rows up to
    :data:`MAX_CHUNKS`. A program's rows are copied one block after another, so fewer,
    longer programs made a decode layer's combine latency-bound (29 us at 300 rows
    with 64 rows a program, measured on the H200)."""
    return max(1, min(MAX_CHUNKS, -(-C // BLOCK_R)))


def dispatch_send(hidden: torch.Tensor, inv: torch.Tensor, pair_tags: torch.Tensor, top_k: int,
                  me: int, C: int, row_elems: int, table: torch.Tensor, active: torch.Tensor,
                  counter: torch.Tensor, my_flags: torch.Tensor, slot: int,
                  reset_prev: bool = False) -> None:
    """Launch the dispatch send kernel (CUDA; see the module doc).

    Args:
        hidden: [T, H] model dtype, rows contiguous; inv: [G*C] int64; pair_tags: [T*k]
            int32; row_elems: W, elements per receive row (:func:`row_width`);
        table: [G, 3] int64 device pointers; active: [G] int32; counter: [G] int32 (zero
            between kernels); my_flags: [G, n_slots] int32, this rank's flags; slot: the
            exchange's flag column;
        reset_prev: also clear this rank's flags of column ``slot - 1`` (mod n_slots),
            the exchange before this one, whose waits did not reset them.
    """
    G, n_slots = my_flags.shape
    H = hidden.shape[1]
    chunks = chunks_for(C)
    split = split_for(chunks, H)
    elem = hidden.element_size()
    _dispatch_send_kernel[(G, chunks, split)](
        hidden, hidden.stride(0), inv, pair_tags, table, active, counter, my_flags, me, C,
        slot, n_slots, chunks, split, top_k, H=H, ROW_ELEMS=row_elems,
        ROW_WORDS=row_elems * elem // 4, BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H,
        RESET_PREV=reset_prev, num_warps=NUM_WARPS)


def fused_dispatch_ok(hidden: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether :func:`fused_dispatch` takes this step (CUDA, decode-sized)."""
    return (triton is not None and hidden.is_cuda and topk_ids.numel() <= PLAN_MAX_PAIRS
            and hidden.stride(1) == 1)


def fused_dispatch(hidden: torch.Tensor, topk_ids: torch.Tensor, logical_to_physical: torch.Tensor,
                   slots_per_rank: int, me: int, C: int, row_elems: int, table: torch.Tensor,
                   active: torch.Tensor, counter: torch.Tensor, my_flags: torch.Tensor,
                   slot: int, reset_prev: bool = False) -> torch.Tensor:
    """Gather each pair's physical slot (``logical_to_physical[topk_ids]``, the static
    dispatch map of a layer), plan and send, in one kernel (CUDA,
    :func:`fused_dispatch_ok`). Writes what :func:`dispatch_send` writes after
    :func:`fused_plan`.

    Args:
        hidden: [T, H] model dtype; topk_ids: [T, k] int64 logical experts;
        logical_to_physical: [E] int64; the rest as :func:`dispatch_send`.

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
    split = split_for(chunks, hidden.shape[1])
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
        BLOCK_P=FUSED_BLOCK_P, BLOCK_N=_scan_block(ids.numel()), BLOCK_R=BLOCK_R,
        BLOCK_H=BLOCK_H, RESET_PREV=reset_prev, ONE_BLOCK=chunks == 1,
        ROUTE=route is not None, num_warps=NUM_WARPS, **rule_args)


def combine_send(expert_out: torch.Tensor, recv0: torch.Tensor, me: int, C: int,
                 table: torch.Tensor, active: torch.Tensor, counter: torch.Tensor,
                 my_flags: torch.Tensor, slot: int, reset_prev: bool = False) -> None:
    """Launch the combine send kernel (CUDA).

    Args:
        expert_out: [G*C, H] model dtype, contiguous; recv0: this rank's dispatch receive
            buffer ``[G*C_max, W]`` (its tags say which rows to send back); the rest as
            in :func:`dispatch_send`.
    """
    G, n_slots = my_flags.shape
    H = expert_out.shape[1]
    chunks = chunks_for(C)
    split = split_for(chunks, H)
    _combine_send_kernel[(G, chunks, split)](
        expert_out, recv0.view(torch.int32), table, active, counter, my_flags, me, C, slot,
        n_slots, chunks, split, H=H, ROW_WORDS=recv0.shape[1] * recv0.element_size() // 4,
        BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H, RESET_PREV=reset_prev, num_warps=NUM_WARPS)


def down_combine_send(act: torch.Tensor, tags: torch.Tensor, bound: torch.Tensor,
                      w2: torch.Tensor, me: int, C: int, table: torch.Tensor,
                      active: torch.Tensor, counter: torch.Tensor, my_flags: torch.Tensor,
                      slot: int, reset_prev: bool = False) -> None:
    """The received rows' down projection and the combine send in one kernel (CUDA).

    What :func:`~elasticep.moe.experts.small_batch_experts.swiglu_rows`' second kernel and then
    :func:`combine_send` do, without the ``expert_out`` rows in between: each row's
    output goes straight to its source's combine buffer, and each source is signalled
    as :func:`combine_send` signals it.

    Args:
        act: [G*C, I] model dtype, contiguous: the rows' ``silu(gate x) * (up x)``
            (:func:`~elasticep.moe.experts.small_batch_experts.gate_up_rows`).
        tags: [G*C] int32 as received (any stride); bound: [G] int32, each source's
            tag bound (:meth:`~elasticep.moe.exchange.ipc_exchange.IpcExchange.tag_cap`): a tag is
            read as ``clamp(tag, 0, bound[source])``, and only rows with a tag left are
            sent.
        w2: [S, H, I] contiguous, the layer's down projections.
        me, C, table, active, counter, my_flags, slot, reset_prev: as in
            :func:`combine_send` (``slot``: the combine's flag column).
    """
    G, n_slots = my_flags.shape
    N, inter = act.shape
    H = w2.shape[1]
    bo, bk, warps = DOWN_TILE
    _down_combine_send_kernel[(N, triton.cdiv(H, bo))](
        act, tags, tags.stride(0), bound, w2, table, active, counter, my_flags, me, C, slot,
        n_slots, H, inter, BLOCK_O=bo, BLOCK_K=bk, RESET_PREV=reset_prev, num_warps=warps)
