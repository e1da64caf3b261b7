"""Placement changes on membership change: repair, scale-up, scale-down, and the loads they need.

Every function here is a pure function of its arguments (no randomness, no messages),
so all survivors that see the same membership compute the same placement.

Repair after a failure (:func:`repair_placement`), for each layer:
  1. slots of ranks that left are emptied; every other slot keeps its expert;
  2. experts left without a live replica (orphans) are placed, in ascending id order,
     into (a) an empty slot of a live rank, else (b) a slot holding a replica of the
     expert with the most live replicas (never its last one); among equal choices, the
     rank that received the fewest orphans so far, then the lowest rank and slot;
  3. if (a) and (b) cannot hold every orphan (R = 0, say), every rank first grows by
     ``ceil(shortfall / live ranks)`` empty local slots, so no expert is ever dropped.
Which weights must then be fetched is :func:`plan_expert_loads` (both at once:
:func:`repair_and_plan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from elasticep.eplb.placement import Placement


@dataclass(frozen=True)
class ExpertLoad:
    """One slot that must receive an expert's weights after a placement change.

    Attributes:
        layer: MoE layer index.
        rank: the rank that owns the target slot.
        local_slot: the target's index among ``rank``'s slots (new layout).
        slot: the target's global physical slot id in the new placement.
        logical_expert: the expert to load.
        source_rank: a rank that holds the expert in the old placement and is still
            reachable (possibly ``rank`` itself: a local copy), or None when no live
            rank has it and it must come from the checkpoint (an orphan).
        source_local_slot: the slot on ``source_rank`` (old layout), or None.
    """

    layer: int
    rank: int
    local_slot: int
    slot: int
    logical_expert: int
    source_rank: int | None
    source_local_slot: int | None


def _check_mask(placement: Placement, active_ranks: torch.Tensor) -> torch.Tensor:
    mask = active_ranks.to(torch.bool).cpu().flatten()
    if mask.numel() != placement.max_ep_size:
        raise ValueError(f"active_ranks has {mask.numel()} entries, want {placement.max_ep_size}")
    if not bool(mask.any()):
        raise ValueError("no active rank is left")
    return mask


def _grid(placement: Placement) -> torch.Tensor:
    """[L, M, S] copy of phy2log, indexed by (layer, rank, local slot)."""
    L, M, S = placement.num_layers, placement.max_ep_size, placement.slots_per_rank
    return placement.phy2log.clone().view(L, M, S)


def _place_orphans(grid: torch.Tensor, mask: torch.Tensor, E: int) -> None:
    """Give every expert of every layer a live replica, in place (see module docstring)."""
    L, M, S = grid.shape
    live = [int(r) for r in torch.nonzero(mask).flatten()]
    for layer in range(L):
        g = grid[layer]
        count = torch.bincount(g[live].flatten(), minlength=E + 1)[:E].tolist()
        orphans = [e for e in range(E) if count[e] == 0]
        received = dict.fromkeys(live, 0)
        for e in orphans:
            best, best_key = None, None
            for r in live:
                for j, held in enumerate(g[r].tolist()):
                    if held == E:
                        key = (0, 0, received[r], r, j)
                    elif count[held] >= 2:
                        key = (1, -count[held], received[r], r, j)
                    else:
                        continue
                    if best_key is None or key < best_key:
                        best, best_key = (r, j, held), key
            if best is None:
                # repair_placement grows the slots first, so this is a bug, not bad input.
                raise RuntimeError(f"layer {layer}: no slot left for orphan expert {e}")
            r, j, held = best
            if held != E:
                count[held] -= 1
            g[r, j] = e
            count[e] = 1
            received[r] += 1


def _shortfall(grid: torch.Tensor, mask: torch.Tensor, E: int) -> int:
    """Largest number, over layers, of orphans that no free or redundant slot can hold."""
    worst = 0
    for layer in range(grid.shape[0]):
        held = grid[layer][mask].flatten()
        count = torch.bincount(held, minlength=E + 1)
        free = int(count[E]) + int((count[:E] - 1).clamp(min=0).sum())
        orphans = int((count[:E] == 0).sum())
        worst = max(worst, orphans - free)
    return worst


def repair_placement(placement: Placement, active_ranks: torch.Tensor) -> Placement:
    """The placement after ranks left: survivors keep their experts, orphans are re-homed.

    Args:
        placement: the current placement.
        active_ranks: [max_ep_size] bool, the new membership; must be a subset of
            ``placement.active_ranks`` (admissions go through :func:`scale_up_placement`).

    Returns:
        A placement over ``active_ranks`` in which every logical expert of every layer has
        at least one slot; ``slots_per_rank`` grows only if the survivors' slots cannot
        hold every expert.

    Raises:
        ValueError: if the mask is malformed, empty, or admits new ranks.
    """
    mask = _check_mask(placement, active_ranks)
    if bool((mask & ~placement.active_ranks).any()):
        raise ValueError("repair_placement cannot admit ranks; use scale_up_placement")
    E = placement.num_logical_experts
    grid = _grid(placement)
    grid[:, ~mask, :] = E
    short = _shortfall(grid, mask, E)
    if short > 0:
        extra = math.ceil(short / int(mask.sum()))
        L, M, S = grid.shape
        grown = torch.full((L, M, S + extra), E, dtype=torch.int64)
        grown[:, :, :S] = grid
        grid = grown
    _place_orphans(grid, mask, E)
    return Placement(grid.view(grid.shape[0], -1), E, grid.shape[2], mask.clone())


def repair_and_plan(placement: Placement, active_ranks: torch.Tensor) -> tuple[Placement, list[ExpertLoad]]:
    """:func:`repair_placement` plus the loads it needs (orphans: ``source_rank`` None).

    Pure: every survivor calls it with the same (placement, membership) and gets the
    same placement and the same load list, with no messages.
    """
    new = repair_placement(placement, active_ranks)
    return new, plan_expert_loads(placement, new)


def scale_down_placement(placement: Placement, leaving_ranks: list[int]) -> Placement:
    """The placement once ``leaving_ranks`` are drained: their experts move to the others.

    Same rules as :func:`repair_placement`; the difference is only in the loads: the
    leaving ranks are still alive, so pass ``source_ranks=placement.active_ranks`` to
    :func:`plan_expert_loads` and orphans are copied from them instead of the checkpoint.

    Raises:
        ValueError: if a leaving rank is not active, or no rank would remain.
    """
    mask = placement.active_ranks.clone()
    for r in leaving_ranks:
        if not (0 <= r < mask.numel()) or not bool(mask[r]):
            raise ValueError(f"rank {r} is not active")
        mask[r] = False
    return repair_placement(placement, mask)


def scale_up_placement(
    placement: Placement, active_ranks: torch.Tensor, weight: torch.Tensor | None = None
) -> Placement:
    """Admit new ranks: their slots become live and are filled with replicas.

    Existing experts stay where they are, and the old ranks' empty slots stay empty: they
    are the reserve (``--min-ep-size``, or room left by an earlier growth) that lets a
    later failure re-home orphans without growing, and filling them would add weight
    moves to the admission. Every slot of the new ranks is filled, local slot by local
    slot across them, with the expert of the
    largest ``weight / replicas`` that the rank does not hold yet (lowest id on ties;
    with no weight that is the expert with the fewest replicas), spreading replicas.

    Args:
        placement: the current placement.
        active_ranks: [max_ep_size] bool, a superset of ``placement.active_ranks``.
        weight: [L, E] load per expert (e.g. EPLB counts); default uniform.

    Returns:
        The placement over ``active_ranks`` with the same ``slots_per_rank``.

    Raises:
        ValueError: if the mask drops a rank or the weight has the wrong shape.
    """
    mask = _check_mask(placement, active_ranks)
    if bool((placement.active_ranks & ~mask).any()):
        raise ValueError("scale_up_placement cannot drop ranks; use repair_placement")
    E, L = placement.num_logical_experts, placement.num_layers
    if weight is None:
        weight = torch.ones(L, E)
    if tuple(weight.shape) != (L, E):
        raise ValueError(f"weight must be [{L}, {E}], got {tuple(weight.shape)}")
    weight = weight.double().cpu()
    joiners = [int(r) for r in torch.nonzero(mask & ~placement.active_ranks).flatten()]
    grid = _grid(placement)
    counts = placement.replica_counts().double()
    for layer in range(L):
        count = counts[layer]
        for j in range(placement.slots_per_rank):
            for r in joiners:
                if int(grid[layer, r, j]) != E:
                    continue
                score = weight[layer] / count
                score[grid[layer, r][grid[layer, r] < E]] = -math.inf  # not twice on one rank
                if not bool(torch.isfinite(score).any()):
                    score = weight[layer] / count  # the rank holds every expert already
                e = int(torch.argmax(score))  # first maximum: lowest id on ties
                grid[layer, r, j] = e
                count[e] += 1
    return Placement(grid.view(L, -1), E, placement.slots_per_rank, mask.clone())


def reconcile_placement(
    placement: Placement, active_ranks: torch.Tensor, weight: torch.Tensor | None = None
) -> Placement:
    """Repair for the ranks that left, then scale up for the ranks that joined."""
    mask = _check_mask(placement, active_ranks)
    repaired = repair_placement(placement, mask & placement.active_ranks)
    if bool((mask & ~placement.active_ranks).any()):
        return scale_up_placement(repaired, mask, weight)
    return repaired


def plan_expert_loads(
    old: Placement, new: Placement, source_ranks: torch.Tensor | None = None
) -> list[ExpertLoad]:
    """Every (layer, rank, local slot) of ``new`` whose expert is not already in place.

    A slot is in place when the same rank held the same expert in the same local slot
    in ``old`` and was active there. The source of each load is the target rank itself
    when it already holds the expert elsewhere, else the holder at the smallest forward
    ring distance ``(source - target) % max_ep_size`` (spreads the senders), else None
    (checkpoint).

    Args:
        old: the placement the weights are laid out in now.
        new: the target placement (its ``slots_per_rank`` may be larger).
        source_ranks: [max_ep_size] bool, ranks that can send; default the ranks active
            in both placements.

    Returns:
        Loads sorted by (layer, rank, local_slot); every rank derives the same list.

    Raises:
        ValueError: if the placements disagree on layers, experts or rank capacity.
    """
    if (old.num_layers, old.num_logical_experts, old.max_ep_size) != (
        new.num_layers, new.num_logical_experts, new.max_ep_size
    ):
        raise ValueError("placements differ in layers, experts or max_ep_size")
    if new.slots_per_rank < old.slots_per_rank:
        raise ValueError("slots_per_rank can only grow")
    if source_ranks is None:
        source_ranks = old.active_ranks & new.active_ranks
    src_mask = source_ranks.to(torch.bool).cpu()
    E, M = new.num_logical_experts, new.max_ep_size
    before = old.with_slots_per_rank(new.slots_per_rank)
    S = new.slots_per_rank
    old_grid = before.phy2log.view(old.num_layers, M, S)
    new_grid = new.phy2log.view(new.num_layers, M, S)
    loads = []
    for layer, r, j in torch.nonzero((new_grid != E) & (new_grid != old_grid)).tolist():
        e = int(new_grid[layer, r, j])
        src, src_slot = None, None
        for dist in range(M):
            cand = (r + dist) % M
            if not bool(src_mask[cand]):
                continue
            hits = torch.nonzero(old_grid[layer, cand] == e).flatten()
            if hits.numel():
                src, src_slot = cand, int(hits[0])
                break
        loads.append(ExpertLoad(layer, r, j, r * S + j, e, src, src_slot))
    return loads
