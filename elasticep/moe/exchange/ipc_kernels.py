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
The kernels that also route or compute (the fused forms) are in
:mod:`elasticep.moe.fused_exchange_kernels`; they share the device helpers below.
"""

from __future__ import annotations

import torch

from elasticep.moe.exchange.padded_exchange import split_rows

try:  # Triton is absent on CPU-only installs; the reference functions need none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only machines
    triton = None


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
    def _send_program(my_flags_ptr, me, n_slots, slot, split, H, BLOCK_H: tl.constexpr,
                      RESET_PREV: tl.constexpr):
        # Program (q, c, part) of a send grid: destination q, chunk c of its rows, part
        # ``part`` of their columns ([h_lo, h_hi)); it first clears the flag of the
        # exchange before (_reset_prev).
        q = tl.program_id(0)
        c = tl.program_id(1)
        part = tl.program_id(2)
        _reset_prev(my_flags_ptr, q, me, n_slots, slot, c, part, RESET_PREV)
        h_lo, h_hi = _col_range(H, split, part, BLOCK_H)
        return q, c, part, h_lo, h_hi

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

    # top_k too: warm_kernels compiles with one pair a token, and a model's top-k of 1
    # against 8 is another compiled form (Triton specializes an integer equal to 1),
    # which a served rank's first prefill step compiled on the request path (0.48 s).
    @triton.jit(do_not_specialize=["me", "C", "slot", "chunks", "split", "top_k"])
    def _dispatch_send_kernel(hidden_ptr, stride_hidden, inv_ptr, tag_ptr, table_ptr,
                              active_ptr, counter_ptr, my_flags_ptr, me, C, slot, n_slots,
                              chunks, split, top_k, H: tl.constexpr, ROW_ELEMS: tl.constexpr,
                              ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_H: tl.constexpr, RESET_PREV: tl.constexpr):
        # program (q, c, part): rows of chunk c bound for q, columns of part ``part``
        q, c, part, h_lo, h_hi = _send_program(my_flags_ptr, me, n_slots, slot, split, H,
                                               BLOCK_H, RESET_PREV)
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

    @triton.jit(do_not_specialize=["me", "C", "slot", "chunks", "split"])
    def _combine_send_kernel(out_ptr, recv32_ptr, table_ptr, active_ptr, counter_ptr,
                             my_flags_ptr, me, C, slot, n_slots, chunks, split, H: tl.constexpr,
                             ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_H: tl.constexpr, RESET_PREV: tl.constexpr):
        q, c, part, h_lo, h_hi = _send_program(my_flags_ptr, me, n_slots, slot, split, H,
                                               BLOCK_H, RESET_PREV)
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
