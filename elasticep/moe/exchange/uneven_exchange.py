"""Replica choice and the token exchange of expert parallelism (CPU path).

Each (token, choice) pair picks one physical slot of its logical expert:
  - ``static``: ``logical_to_rank_dispatch_physical_map`` (nearest replica, see
    :mod:`elasticep.eplb.metadata`);
  - ``dynamic``: replica number ``(t * k + j + ep_rank) % num_replicas`` of the expert,
    a deterministic round robin over the pairs that spreads one expert's tokens over
    all its replicas (and different senders start at different replicas).
The pairs are then exchanged with ``all_to_all_single``: first the per-rank pair counts
(int64, one entry per rank of the group), then the hidden rows and their local slot ids
with those uneven splits. Ranks that host no chosen slot, inactive ones included, get
zero splits. :func:`uneven_combine` runs the reverse exchange, with the layout
:func:`uneven_dispatch` returns in its handle, and sums each token's k outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from elasticep.config import DispatchAlgorithm
from elasticep.eplb.metadata import ExpertLocationMetadata
from elasticep.moe.exchange.pair_combine import combine_pairs


def choose_physical_slots(
    metadata: ExpertLocationMetadata,
    layer_idx: int,
    topk_ids: torch.Tensor,
    algorithm: DispatchAlgorithm,
) -> torch.Tensor:
    """Map every (token, choice) to a physical slot.

    Args:
        metadata: expert locations, for this rank.
        layer_idx: layer whose placement row applies.
        topk_ids: [T, k] int64 logical expert ids (CPU).
        algorithm: ``"static"`` or ``"dynamic"``.

    Returns:
        [T, k] int64 physical slot ids, each hosting the pair's logical expert.

    Raises:
        ValueError: on an unknown algorithm.
    """
    if algorithm == "static":
        return metadata.logical_to_rank_dispatch_physical_map_cpu[layer_idx][topk_ids]
    if algorithm == "dynamic":
        T, k = topk_ids.shape
        n = metadata.logical_to_all_physical_map_num_valid_cpu[layer_idx][topk_ids]
        pick = (torch.arange(T * k).view(T, k) + metadata.ep_rank) % n
        return metadata.logical_to_all_physical_map_cpu[layer_idx][topk_ids, pick]
    raise ValueError(f"unknown dispatch algorithm {algorithm!r}")


@dataclass(frozen=True)
class UnevenHandle:
    """The layout of one :func:`uneven_dispatch`, which :func:`uneven_combine` takes back.

    Attributes:
        order: [N] int64, the flat (token, choice) index of each sent row.
        send_splits: rows sent to each rank of the group.
        recv_splits: rows received from each rank.
        dtype: the dispatched hidden states' dtype, which the combine returns.
    """

    order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    dtype: torch.dtype


def uneven_dispatch(
    hidden_states: torch.Tensor,
    slots: torch.Tensor,
    slots_per_rank: int,
    group_size: int,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, UnevenHandle]:
    """Send each (token, choice) row to the rank that owns its slot.

    The membership is not an argument: inactive ranks host no chosen slot, so they get
    zero splits.

    Args:
        hidden_states: [T, H] model dtype.
        slots: [T, k] int64 physical slot per pair.
        slots_per_rank: slot ``p`` lives on rank ``p // slots_per_rank``.
        group_size: ranks in ``group`` (``max_ep_size`` for an elastic group).
        group: the EP group.

    Returns:
        recv_hidden: [N_recv, H] rows this rank must run, grouped by sender.
        recv_local_slots: [N_recv] int64 local slot of each row.
        handle: for :func:`uneven_combine`.
    """
    k = slots.shape[1]
    flat = slots.reshape(-1)
    # Stable sort by slot: grouped by destination rank, same-slot rows adjacent.
    order = torch.argsort(flat, stable=True)
    sorted_slots = flat[order]
    dest = torch.div(sorted_slots, slots_per_rank, rounding_mode="floor")
    send_counts = torch.bincount(dest, minlength=group_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    n_recv = sum(recv_splits)
    send_rows = hidden_states[torch.div(order, k, rounding_mode="floor")]
    recv_hidden = hidden_states.new_empty(n_recv, hidden_states.shape[1])
    dist.all_to_all_single(recv_hidden, send_rows, recv_splits, send_splits, group=group)
    local = sorted_slots - dest * slots_per_rank
    recv_local = torch.empty(n_recv, dtype=torch.int64)
    dist.all_to_all_single(recv_local, local, recv_splits, send_splits, group=group)
    handle = UnevenHandle(order, send_splits, recv_splits, hidden_states.dtype)
    return recv_hidden, recv_local, handle


def uneven_combine(expert_out: torch.Tensor, handle: UnevenHandle, weights: torch.Tensor,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """Return expert outputs to their senders and sum each token's k of them.

    Args:
        expert_out: [N_recv, H] the expert output of every received row, same order.
        handle: from :func:`uneven_dispatch`.
        weights: [T, k] float32 combine weights of this rank's pairs.
        group: the EP group.

    Returns:
        [T, H] in ``handle.dtype``: ``sum_j weights[t, j] * out(t, j)``, summed in
        float32 like the dense reference
        (:func:`~elasticep.moe.exchange.pair_combine.combine_pairs`).
    """
    back = expert_out.new_empty(sum(handle.send_splits), expert_out.shape[1])
    dist.all_to_all_single(back, expert_out.contiguous(), handle.send_splits,
                           handle.recv_splits, group=group)
    pairs = expert_out.new_empty(weights.numel(), expert_out.shape[1])
    pairs[handle.order] = back
    return combine_pairs(pairs, weights, handle.dtype)
