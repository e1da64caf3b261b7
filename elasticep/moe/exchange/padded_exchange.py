"""Fixed-capacity token exchange of expert parallelism (the GPU dispatch/combine).

The CPU path (:mod:`elasticep.moe.exchange.uneven_exchange`) first exchanges per-rank
pair counts and then moves rows with uneven splits; on a GPU those counts would have to
reach the host (a device sync per layer). Here every rank instead sends exactly ``capacity`` rows to
every rank of the group, so ``all_to_all_single`` needs no split sizes and everything
stays on the device:

* send buffer ``[G * C, W]`` (model dtype): block ``d`` (rows ``d*C .. d*C + C``) holds
  the pairs bound for rank ``d``, in flat (token, choice) order, then zero padding;
* each row's first ``H`` columns are the token's hidden state and its last 4 bytes an
  int32 tag: ``local slot + 1`` for a real row, ``0`` for padding. Zero means "empty"
  on purpose: an elastic group zero-fills the rows of inactive ranks, which therefore
  read as padding too. ``W`` (:func:`row_width`) pads the row to a multiple of 16 elements.

The tag rides in the row instead of a tensor of its own so that a dispatch is one
all_to_all, not two: at decode batch sizes an all_to_all costs its latency (tens of
microseconds on NVLink), not its bytes, and a layer pays it for every exchange.

``capacity`` must be the same on every rank and at least the most pairs one rank can
send to one destination, ``max_tokens * min(top_k, slots_per_rank)`` (a token sends
each of its k choices to one slot, and distinct choices of one token sit in distinct
slots), so no pair is ever dropped (:func:`pair_capacity`).

Every buffer comes from an :data:`Alloc`. By default each call allocates afresh; a CUDA
graph capture passes :class:`ExchangeBuffers` instead, so the graph pieces and the eager
all_to_alls between them (:mod:`elasticep.utils.graph_boundary`) meet in the same
storage at every replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import elasticep.distributed as ed
from elasticep.moe.exchange.pair_combine import combine_pairs

# Row blocks are rounded to this many rows (keeps each block 16-byte aligned for any
# dtype and the grouped GEMM's inputs aligned).
ROW_ALIGN = 8

Exchange = Callable[[torch.Tensor, torch.Tensor], None]
# alloc(name, rows, like) -> an uninitialised [rows, *like.shape[1:]] tensor of like's
# dtype and device; the name says which buffer of the exchange it is.
Alloc = Callable[[str, int, torch.Tensor], torch.Tensor]


def fresh(name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The default :data:`Alloc`: a new tensor at every call."""
    return like.new_empty(rows, *like.shape[1:])


class ExchangeBuffers:
    """Named buffers kept between calls: the :data:`Alloc` of a graph-captured exchange.

    A request for more rows than a buffer holds grows it only while ``may_grow()`` is
    true (a warm-up pass before a capture); otherwise it is served by a fresh tensor,
    so an eager prefill larger than every captured bucket never moves the storage that
    graphs point to. Each growth bumps :attr:`generation`, which tells graph owners
    that earlier captures point to freed storage.

    Args:
        may_grow: whether buffers may be (re)allocated now.
    """

    def __init__(self, may_grow: Callable[[], bool]) -> None:
        self.may_grow = may_grow
        self.generation = 0
        self._bufs: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(name)
        fits = (buf is not None and buf.shape[0] >= rows and buf.shape[1:] == like.shape[1:]
                and buf.dtype == like.dtype and buf.device == like.device)
        if fits:
            return buf[:rows]
        if not self.may_grow():
            return fresh(name, rows, like)
        self._bufs[name] = fresh(name, rows, like)
        self.generation += 1
        return self._bufs[name]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def pair_capacity(max_tokens: int, top_k: int, slots_per_rank: int) -> int:
    """Rows each rank sends to each rank per layer; no pair can overflow it.

    Args:
        max_tokens: the most tokens any rank of the group has in this step.
        top_k: experts per token.
        slots_per_rank: physical expert slots per rank.

    Returns:
        ``max_tokens * min(top_k, slots_per_rank)`` rounded up to ``ROW_ALIGN`` (at least
        ``ROW_ALIGN``, so an idle step still exchanges well-formed buffers).

    Raises:
        ValueError: on a negative count or a non-positive top_k / slots_per_rank.
    """
    if max_tokens < 0 or top_k <= 0 or slots_per_rank <= 0:
        raise ValueError(f"bad capacity inputs: tokens={max_tokens} k={top_k} "
                         f"slots={slots_per_rank}")
    rows = max(max_tokens * min(top_k, slots_per_rank), 1)
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


@dataclass
class PaddedPlan:
    """Where each flat (token, choice) pair travels.

    Attributes:
        position: [T*k] int64, the pair's row in the ``[G*C]`` send buffer (device).
        tag: [T*k] int32, ``local slot + 1`` of the pair on its destination rank.
        group_size: G; capacity: C.
    """

    position: torch.Tensor
    tag: torch.Tensor
    group_size: int
    capacity: int


def plan_padded(slots: torch.Tensor, slots_per_rank: int, group_size: int,
                capacity: int) -> PaddedPlan:
    """Lay out the pairs in the fixed-capacity send buffer, without a host sync.

    Args:
        slots: [T, k] int64 physical slot of each pair (any device).
        slots_per_rank: slot ``p`` lives on rank ``p // slots_per_rank``.
        group_size: G, ranks of the group (``max_ep_size`` for an elastic group).
        capacity: C rows per destination (see :func:`pair_capacity`). Not checked
            against the data here (that would sync); an undersized C corrupts output.

    Returns:
        The :class:`PaddedPlan`.
    """
    flat = slots.reshape(-1)
    dest = torch.div(flat, slots_per_rank, rounding_mode="floor")
    # a radix sort takes a pass per key byte: rank ids fit int16 (2 passes, not 8)
    order = torch.argsort(dest.to(torch.int16) if group_size < 2**15 else dest, stable=True)
    # bincount would read the largest rank id on the host (a sync); scatter_add does not
    counts = torch.zeros(group_size, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, dest, torch.ones_like(dest))
    first = torch.cumsum(counts, 0) - counts  # index in `order` of each rank's first pair
    sorted_dest = dest[order]
    within = torch.arange(flat.numel(), device=flat.device) - first[sorted_dest]
    position = torch.empty_like(flat)
    position[order] = sorted_dest * capacity + within
    tag = (flat - dest * slots_per_rank + 1).to(torch.int32)
    return PaddedPlan(position, tag, group_size, capacity)


# A row's element count is a multiple of this. Triton specializes an integer argument
# only when it is divisible by 16, and the expert kernels that read the received rows
# in place (row stride W) can prove their loads aligned, and issue them as 16-byte
# vectors, only then: W = 2056 (Qwen3's 2048 values and the tag, bf16) is not.
ROW_ELEMS_ALIGN = 16


def row_width(hidden_size: int, dtype: torch.dtype) -> int:
    """Columns of an exchanged row: ``hidden_size`` values, then room for the int32 tag,
    rounded up to a multiple of :data:`ROW_ELEMS_ALIGN` elements (so also of 16 bytes)."""
    size = torch.empty((), dtype=dtype).element_size()
    values = hidden_size + -(-4 // size)  # the tag takes 4 bytes: 2 bf16 or 1 fp32 value
    return -(-values // ROW_ELEMS_ALIGN) * ROW_ELEMS_ALIGN


def split_rows(buf: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a contiguous ``[N, W]`` exchange buffer: rows ``[N, H]`` (row stride W)
    and tags ``[N]`` int32 (the last 4 bytes of each row)."""
    return buf[:, :hidden_size], buf.view(torch.int32)[:, -1]


def pack(hidden: torch.Tensor, top_k: int, plan: PaddedPlan, alloc: Alloc = fresh
         ) -> torch.Tensor:
    """Build this rank's send buffer.

    Args:
        hidden: [T, H] model dtype; top_k: k; plan: from :func:`plan_padded`;
        alloc: where the buffer comes from (name ``send``).

    Returns:
        [G*C, W] model dtype, W = :func:`row_width`: pair rows at their positions, with
        their tags (``local slot + 1``); zeros elsewhere (:func:`split_rows` reads it).
    """
    H = hidden.shape[1]
    n = plan.group_size * plan.capacity
    buf = alloc("send", n, hidden.new_empty(0, row_width(H, hidden.dtype))).zero_()
    rows, tags = split_rows(buf, H)
    token = torch.div(torch.arange(plan.position.numel(), device=hidden.device), top_k,
                      rounding_mode="floor")
    rows[plan.position] = hidden[token]
    tags[plan.position] = plan.tag
    return buf


def exchange_over(group: dist.ProcessGroup | None) -> Exchange:
    """An :data:`Exchange` doing one even-split ``all_to_all_single`` over `group`
    (:func:`elasticep.distributed.all_to_all_single`: for an elastic group in steady
    state it skips torch.distributed's dispatch; any other group goes through it)."""

    def run(out: torch.Tensor, inp: torch.Tensor) -> None:
        ed.all_to_all_single(out, inp, group=group)

    return run


@dataclass(frozen=True)
class PaddedHandle:
    """The layout of one padded dispatch, which its combine takes back (the handle of
    DeepEP's ``dispatch``/``combine`` pair; the same-host exchange's handle extends it).

    Attributes:
        position: [T*k] int64, each flat (token, choice) pair's row in the ``[G*C]``
            layout; the combine reads the pair's output back from that row.
        capacity: C, rows per rank block.
        dtype: the dispatched hidden states' dtype, which the combine returns.
    """

    position: torch.Tensor
    capacity: int
    dtype: torch.dtype


def padded_dispatch(hidden: torch.Tensor, slots: torch.Tensor, slots_per_rank: int,
                    group_size: int, capacity: int, exchange: Exchange, alloc: Alloc = fresh
                    ) -> tuple[torch.Tensor, torch.Tensor, PaddedHandle]:
    """Send every pair to the rank owning its slot (one even all_to_all, no sync).

    The membership is not an argument: an elastic group zero-fills the blocks of
    inactive ranks, whose rows therefore read as padding.

    Args:
        hidden: [T, H]; slots: [T, k] int64 physical slots; others as in
        :func:`plan_padded`; exchange: the all_to_all (:func:`exchange_over`);
        alloc: buffer source (``send``, ``recv``).

    Returns:
        recv_rows: [G*C, H] (a strided view, row stride :func:`row_width`), block ``s``
        from sender ``s``; recv_tags: [G*C] int32 (a strided view, ``local slot + 1``,
        0 for padding); handle: for :func:`padded_combine`.
    """
    plan = plan_padded(slots, slots_per_rank, group_size, capacity)
    send = pack(hidden, slots.shape[1], plan, alloc)
    recv = alloc("recv", send.shape[0], send)
    exchange(recv, send)
    recv_rows, recv_tags = split_rows(recv, hidden.shape[1])
    return recv_rows, recv_tags, PaddedHandle(plan.position, capacity, hidden.dtype)


def padded_combine(expert_out: torch.Tensor, handle: PaddedHandle, weights: torch.Tensor,
                   exchange: Exchange, alloc: Alloc = fresh,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """Return expert outputs to their senders and sum each token's k of them.

    Args:
        expert_out: [G*C, H], rows in the layout :func:`padded_dispatch` received.
        handle: that dispatch's.
        weights: [T, k] float32 combine weights of this rank's pairs.
        exchange: the all_to_all; alloc: the receive buffer's source (``back``).
        dtype: the result dtype (default: the dispatched states', ``handle.dtype``).

    Returns:
        [T, H]: ``sum_j weights[t, j] * out(t, j)``, summed in float32
        (:func:`~elasticep.moe.exchange.pair_combine.combine_pairs`, reading each pair's
        row of the send layout in place).
    """
    back = alloc("back", expert_out.shape[0], expert_out)
    exchange(back, expert_out.contiguous())
    return combine_pairs(back, weights, dtype or handle.dtype, rows=handle.position)
