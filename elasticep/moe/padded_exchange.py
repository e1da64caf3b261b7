"""Fixed-capacity token exchange of expert parallelism (the GPU dispatch/combine).

The CPU path (:mod:`elasticep.moe.dispatch`) first exchanges per-rank pair counts and
then moves rows with uneven splits; on a GPU those counts would have to reach the host
(a device sync per layer). Here every rank instead sends exactly ``capacity`` rows to
every rank of the group, so ``all_to_all_single`` needs no split sizes and everything
stays on the device:

* send buffer ``[G * C, H]``: block ``d`` (rows ``d*C .. d*C + C``) holds the pairs
  bound for rank ``d``, in flat (token, choice) order, then zero padding;
* tag buffer ``[G * C]`` int32: ``local slot + 1`` for a real row, ``0`` for padding.
  Zero means "empty" on purpose: an elastic group zero-fills the rows of inactive
  ranks, which therefore read as padding too.

``capacity`` must be the same on every rank and at least the most pairs one rank can
send to one destination, ``max_tokens * min(top_k, slots_per_rank)`` (a token sends
each of its k choices to one slot, and distinct choices of one token sit in distinct
slots), so no pair is ever dropped (:func:`pair_capacity`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import elasticep.distributed as ed

# Row blocks are rounded to this many rows (keeps each block 16-byte aligned for any
# dtype and the grouped GEMM's inputs aligned).
ROW_ALIGN = 8

Exchange = Callable[[torch.Tensor, torch.Tensor], None]


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
    order = torch.argsort(dest, stable=True)
    counts = torch.bincount(dest, minlength=group_size)
    first = torch.cumsum(counts, 0) - counts  # index in `order` of each rank's first pair
    sorted_dest = dest[order]
    within = torch.arange(flat.numel(), device=flat.device) - first[sorted_dest]
    position = torch.empty_like(flat)
    position[order] = sorted_dest * capacity + within
    tag = (flat - dest * slots_per_rank + 1).to(torch.int32)
    return PaddedPlan(position, tag, group_size, capacity)


def pack(hidden: torch.Tensor, top_k: int, plan: PaddedPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Build this rank's send buffers.

    Args:
        hidden: [T, H] model dtype; top_k: k; plan: from :func:`plan_padded`.

    Returns:
        rows: [G*C, H] (pair rows at their positions, zeros elsewhere);
        tags: [G*C] int32 (``local slot + 1``, 0 for padding).
    """
    n = plan.group_size * plan.capacity
    rows = hidden.new_zeros(n, hidden.shape[1])
    tags = torch.zeros(n, dtype=torch.int32, device=hidden.device)
    token = torch.div(torch.arange(plan.position.numel(), device=hidden.device), top_k,
                      rounding_mode="floor")
    rows[plan.position] = hidden[token]
    tags[plan.position] = plan.tag
    return rows, tags


def unpack(returned: torch.Tensor, plan: PaddedPlan) -> torch.Tensor:
    """[G*C, H] rows sent back by the experts -> [T*k, H] in flat pair order."""
    return returned[plan.position]


def exchange_over(group: dist.ProcessGroup | None) -> Exchange:
    """An :data:`Exchange` doing one even-split ``all_to_all_single`` over `group`
    (:func:`elasticep.distributed.all_to_all_single`: for an elastic group in steady
    state it skips torch.distributed's dispatch; any other group goes through it)."""

    def run(out: torch.Tensor, inp: torch.Tensor) -> None:
        ed.all_to_all_single(out, inp, group=group)

    return run


def padded_dispatch(hidden: torch.Tensor, slots: torch.Tensor, slots_per_rank: int,
                    group_size: int, capacity: int, exchange: Exchange
                    ) -> tuple[torch.Tensor, torch.Tensor, PaddedPlan]:
    """Send every pair to the rank owning its slot (two even all_to_alls, no sync).

    Args:
        hidden: [T, H]; slots: [T, k] int64 physical slots; others as in
        :func:`plan_padded`; exchange: the all_to_all (:func:`exchange_over`).

    Returns:
        recv_rows: [G*C, H], block ``s`` from sender ``s``; recv_tags: [G*C] int32;
        plan: for :func:`padded_combine`.
    """
    plan = plan_padded(slots, slots_per_rank, group_size, capacity)
    rows, tags = pack(hidden, slots.shape[1], plan)
    recv_rows, recv_tags = torch.empty_like(rows), torch.empty_like(tags)
    exchange(recv_rows, rows)
    exchange(recv_tags, tags)
    return recv_rows, recv_tags, plan


def padded_combine(expert_out: torch.Tensor, plan: PaddedPlan, exchange: Exchange
                   ) -> torch.Tensor:
    """Return expert outputs ([G*C, H], same layout as received) to their senders.

    Returns:
        [T*k, H]: the output of each flat (token, choice) pair.
    """
    back = torch.empty_like(expert_out)
    exchange(back, expert_out.contiguous())
    return unpack(back, plan)
