"""Elasticity-aware load rebalance: balance the live ranks, then move as little as possible.

For each layer, over the live ranks only (``n`` ranks of ``S`` slots each):
  1. replica counts: every expert gets one replica, and each of the remaining
     ``n * S - E`` slots goes to the expert with the largest load per replica, among
     experts that still have fewer than ``n`` replicas (so replicas can sit on distinct
     ranks); lowest id on ties;
  2. packing: replicas, heaviest first, go to the lightest rank-sized bin that has room
     and does not hold that expert yet (any bin with room if none qualifies);
  3. matching: bins are given to live ranks greedily by the largest overlap with what
     the rank holds now (ties by lowest bin, then lowest rank), so a rank keeps most of
     its experts;
  4. inside a rank, an expert it already holds keeps its local slot; new experts take
     the freed slots in ascending order.
Dead ranks get nothing, every expert keeps at least one live replica, and rebalancing
twice with the same load moves nothing the second time.
"""

from __future__ import annotations

import torch

from elasticep.eplb.placement import Placement


def _replica_counts(load: torch.Tensor, num_slots: int, cap: int) -> list[int]:
    E = load.numel()
    count = torch.ones(E, dtype=torch.float64)
    for _ in range(num_slots - E):
        score = load / count
        if bool((count < cap).any()):
            score = torch.where(count < cap, score, -torch.inf)
        count[int(torch.argmax(score))] += 1
    return [int(c) for c in count]


def _pack(load: torch.Tensor, count: list[int], num_bins: int, cap: int) -> list[list[int]]:
    replicas = [(float(load[e]) / c, e) for e, c in enumerate(count) for _ in range(c)]
    replicas.sort(key=lambda x: (-x[0], x[1]))
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    bin_load = [0.0] * num_bins
    for w, e in replicas:
        room = [b for b in range(num_bins) if len(bins[b]) < cap]
        fresh = [b for b in room if e not in bins[b]] or room
        b = min(fresh, key=lambda i: (bin_load[i], i))
        bins[b].append(e)
        bin_load[b] += w
    return bins


def _match(bins: list[list[int]], current: dict[int, list[int]]) -> dict[int, list[int]]:
    """Assign bins to ranks, largest multiset overlap first."""
    pairs = []
    for b, content in enumerate(bins):
        for r, held in current.items():
            overlap = sum(min(content.count(e), held.count(e)) for e in set(content))
            pairs.append((-overlap, b, r))
    pairs.sort()
    out: dict[int, list[int]] = {}
    used: set[int] = set()
    for _, b, r in pairs:
        if b in used or r in out:
            continue
        out[r] = bins[b]
        used.add(b)
    return out


def _lay_out(held: list[int], wanted: list[int], empty: int) -> list[int]:
    """Local slot contents for a rank holding ``held`` that should hold ``wanted``."""
    slots = [empty] * len(held)
    todo = list(wanted)
    for j, e in enumerate(held):
        if e in todo:
            slots[j] = e
            todo.remove(e)
    free = [j for j, e in enumerate(slots) if e == empty]
    for j, e in zip(free, sorted(todo), strict=False):
        slots[j] = e
    return slots


def rebalance_placement(
    weight: torch.Tensor, placement: Placement, active_ranks: torch.Tensor | None = None
) -> Placement:
    """A load-balanced placement over the live ranks that keeps experts where they are.

    Args:
        weight: [L, E] load per (layer, logical expert), e.g. token counts; any real dtype.
        placement: the current placement (sets the slot layout and what stays put).
        active_ranks: [max_ep_size] bool, the live ranks, default ``placement.active_ranks``.

    Returns:
        A placement over ``active_ranks`` with the same ``slots_per_rank`` (grown to
        ``ceil(E / live ranks)`` if the live slots could not hold every expert).

    Raises:
        ValueError: on a weight of the wrong shape or an empty or malformed mask.
    """
    L, E, M = placement.num_layers, placement.num_logical_experts, placement.max_ep_size
    if tuple(weight.shape) != (L, E):
        raise ValueError(f"weight must be [{L}, {E}], got {tuple(weight.shape)}")
    mask = placement.active_ranks if active_ranks is None else active_ranks.to(torch.bool).cpu()
    if mask.numel() != M or not bool(mask.any()):
        raise ValueError("active_ranks must be a non-empty [max_ep_size] mask")
    live = [int(r) for r in torch.nonzero(mask).flatten()]
    S = max(placement.slots_per_rank, -(-E // len(live)))
    base = placement.with_slots_per_rank(S)
    grid = base.phy2log.view(L, M, S)
    out = torch.full((L, M, S), E, dtype=torch.int64)
    weight = weight.double().cpu()
    for layer in range(L):
        count = _replica_counts(weight[layer], len(live) * S, len(live))
        bins = _pack(weight[layer], count, len(live), S)
        current = {r: [e for e in grid[layer, r].tolist() if e != E] for r in live}
        for r, wanted in _match(bins, current).items():
            out[layer, r] = torch.tensor(_lay_out(grid[layer, r].tolist(), wanted, E))
    return Placement(out.view(L, -1), E, S, mask.clone())
