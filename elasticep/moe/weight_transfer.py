"""Move expert weights between ranks after a placement change, as a plan says.

The caller passes the load plan (:func:`elasticep.eplb.elastic.plan_expert_loads`, a
pure function of the placements, so every rank holds the same one), and the exchange
needs no negotiation: per layer, one ``all_to_all_single`` whose split sizes every rank
already knows (ranks that neither send nor receive get zero splits, which is also what
an elastic group gives its holes). Local copies and checkpoint reloads (orphans) need
no communication. All ``all_to_all_single`` calls use the weights' dtype on CPU.

Ranks of one host that map each other's memory (``peers``, e.g.
:class:`elasticep.moe.peer_weights.PeerWeights`) skip the collective: each receiver
copies its slots device to device from the source's tensors, and the sources do
nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from elasticep.eplb.elastic import ExpertLoad
from elasticep.eplb.placement import Placement

logger = logging.getLogger(__name__)

# (layer, logical expert) -> (w13 [2*I, H], w2 [H, I]), read from the checkpoint.
CheckpointLoader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


class PeerUnavailable(RuntimeError):
    """A source rank's weights cannot be read (its process is gone)."""


class PeerExperts(Protocol):
    """Other ranks' expert tensors, readable by this rank (mapped memory).

    Attributes:
        departed_copies: orphans copied from a departed rank's memory so far (the mover
            adds to it).
    """

    departed_copies: int

    def experts(self, rank: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Live rank ``rank``'s ``w13`` [S, 2*I, H] and ``w2`` [S, H, I] of MoE layer
        ``layer``, laid out in the change's old placement.

        Raises:
            PeerUnavailable: the rank's memory cannot be read.
        """
        ...

    def departed(self, rank: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`experts`, for a rank that left (died) without a handover: its last
        tensors, where they are still mapped, so its orphans need no checkpoint read.

        Raises:
            PeerUnavailable: not mapped, or the mapping is not of its last tensors.
        """
        ...


def move_expert_weights(
    plan: list[ExpertLoad],
    old: Placement,
    new: Placement,
    rank: int,
    w13: list[torch.Tensor | None],
    w2: list[torch.Tensor | None],
    group: dist.ProcessGroup | None,
    load_fn: CheckpointLoader | None = None,
    peers: PeerExperts | None = None,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Lay this rank's expert weights out for ``new`` in new tensors, carrying out
    ``plan``; the inputs are left as they are.

    Every live member of ``group`` must call this with the same plan and placements.

    Args:
        plan: the loads of the change, ``plan_expert_loads(old, new, source_ranks)``
            (a scale-down passes ``old.active_ranks`` there so leaving ranks still send);
            loads of dense layers are skipped.
        old: the placement ``w13``/``w2`` are laid out in.
        new: the target placement.
        rank: this rank (its index in ``group``).
        w13: per layer, [S_old, 2*I, H] (S_old may be 0 on a newcomer; only the
            trailing dims and dtype are read there), or None for a dense layer, which is
            skipped (it must be None on every rank).
        w2: per layer, [S_old, H, I] or None.
        group: the EP process group (Gloo or elastic); None is the default group.
        load_fn: reads an expert from the checkpoint; needed when this rank receives an
            orphan (a load with no source).
        peers: the sources' tensors, mapped: a receiver copies from them and no rank
            sends (every rank must pass one, or none). An orphan that a rank of ``old``
            still holds in mapped memory (the plan found no source for it, so that rank
            is gone) is copied from there, before falling back to ``load_fn``. Returns
            once the copies are done, so a source may free its old tensors after the
            caller's commit. A source that cannot be read is skipped (logged): its slots
            keep zeros, and the caller's commit, a collective that needs the missing
            source, fails.

    Returns:
        new_w13: per layer [new.slots_per_rank, 2*I, H], None for a dense layer; EMPTY
            slots hold zeros or stale data (never routed to). A layer where nothing
            lands on this rank (same slot count, no expert received, moved or reloaded)
            is returned as the same tensor, so the move holds a second copy only of the
            layers that change.
        new_w2: per layer [new.slots_per_rank, H, I] or None.

    Raises:
        ValueError: on mismatched lists, or an orphan for this rank without ``load_fn``
            (before any collective).
    """
    L = new.num_layers
    if len(w13) != L or len(w2) != L:
        raise ValueError(f"need weights for {L} MoE layers, got {len(w13)} / {len(w2)}")
    loads = [x for x in plan if w13[x.layer] is not None]
    if load_fn is None and any(x.rank == rank and x.source_rank is None for x in loads):
        raise ValueError(f"rank {rank} must reload an orphan but has no checkpoint loader")
    S_old, S = old.slots_per_rank, new.slots_per_rank
    world = new.max_ep_size
    by_layer: list[list[ExpertLoad]] = [[] for _ in range(L)]
    for x in loads:
        by_layer[x.layer].append(x)
    out13: list[torch.Tensor | None] = []
    out2: list[torch.Tensor | None] = []
    pulled: set[torch.device] = set()  # devices with queued peer copies
    missing: set[int] = set()
    departed = _old_holders(old) if peers is not None else {}
    for layer in range(L):
        a, b = w13[layer], w2[layer]
        if a is None or b is None:
            out13.append(None)
            out2.append(None)
            continue
        n13, n2 = a.shape[1] * a.shape[2], b.shape[1] * b.shape[2]
        stays = bool(new.active_ranks[rank] and old.active_ranks[rank]) and S == S_old == a.shape[0]
        if stays and not any(x.rank == rank for x in by_layer[layer]):
            # Nothing lands here: keep the layer's tensors (no second copy of its experts
            # in memory; slots that became empty keep stale data, never routed to).
            if peers is None and any(x.source_rank not in (None, x.rank)
                                     for x in by_layer[layer]):
                _exchange(a, b, a, b, [x for x in by_layer[layer] if x.source_rank == rank],
                          [], n13, n2, world, group)
            out13.append(a)
            out2.append(b)
            continue
        new_a = a.new_zeros(S, *a.shape[1:])
        new_b = b.new_zeros(S, *b.shape[1:])
        if new.active_ranks[rank] and old.active_ranks[rank]:
            # Start from the old local layout: slots in place stay, others are overwritten.
            keep = min(S_old, a.shape[0])
            new_a[:keep], new_b[:keep] = a[:keep], b[:keep]
        send = [x for x in by_layer[layer] if x.source_rank == rank and x.rank != rank]
        recv = [x for x in by_layer[layer] if x.rank == rank and x.source_rank not in (None, rank)]
        for x in by_layer[layer]:
            if x.rank != rank:
                continue
            if x.source_rank == rank:
                new_a[x.local_slot], new_b[x.local_slot] = a[x.source_local_slot], b[x.source_local_slot]
            elif x.source_rank is None:
                if _copy_departed(peers, departed, x, new_a, new_b):
                    if new_a.device.type == "cuda":
                        pulled.add(new_a.device)
                    continue
                ca, cb = load_fn(layer, x.logical_expert)
                new_a[x.local_slot].copy_(ca)
                new_b[x.local_slot].copy_(cb)
        if peers is not None:
            if _pull(peers, layer, new_a, new_b, recv, missing):
                pulled.add(new_a.device)
        elif any(x.source_rank not in (None, x.rank) for x in by_layer[layer]):
            _exchange(a, b, new_a, new_b, send, recv, n13, n2, world, group)
        out13.append(new_a)
        out2.append(new_b)
    if missing:
        logger.warning("rank %d: expert weights of ranks %s cannot be read; their slots "
                       "stay empty, and the change's commit fails without them", rank,
                       sorted(missing))
    for device in pulled:  # the sources may free their tensors once the caller commits
        torch.cuda.synchronize(device)
    return out13, out2


def _old_holders(old: Placement) -> dict[int, torch.Tensor]:
    """The ranks active in ``old`` with their old slots: ``{rank: [L, S_old] int64
    logical experts}``. Only an orphan is looked up here, and the plan gives an orphan
    no source only when no source rank holds it, so every hit is a rank that left."""
    return {int(d): old.local(int(d)) for d in old.active_ranks.nonzero().flatten().tolist()}


def _copy_departed(peers: PeerExperts | None, departed: dict[int, torch.Tensor],
                   x: ExpertLoad, new_a: torch.Tensor, new_b: torch.Tensor) -> bool:
    """Copy orphan ``x`` from a departed holder's mapped tensors (``departed``: from
    :func:`_old_holders`); False if none can."""
    if peers is None:
        return False
    for d, local in departed.items():
        hits = (local[x.layer] == x.logical_expert).nonzero().flatten()
        if hits.numel() == 0:
            continue
        try:
            a, b = peers.departed(d, x.layer)
        except PeerUnavailable:
            continue
        j = int(hits[0])
        new_a[x.local_slot].copy_(a[j], non_blocking=True)
        new_b[x.local_slot].copy_(b[j], non_blocking=True)
        peers.departed_copies += 1
        return True
    return False


def _pull(peers: PeerExperts, layer: int, new_a: torch.Tensor, new_b: torch.Tensor,
          recv: list[ExpertLoad], missing: set[int]) -> bool:
    """Copy ``recv``'s slots of ``layer`` from the sources' mapped tensors; a source that
    cannot be read goes into ``missing``. Returns whether a CUDA copy was queued."""
    queued = False
    for x in recv:
        if x.source_rank in missing:
            continue
        try:
            a, b = peers.experts(x.source_rank, layer)
        except PeerUnavailable:
            missing.add(x.source_rank)
            continue
        new_a[x.local_slot].copy_(a[x.source_local_slot], non_blocking=True)
        new_b[x.local_slot].copy_(b[x.source_local_slot], non_blocking=True)
        queued |= new_a.device.type == "cuda"
    return queued


def _exchange(
    a: torch.Tensor,
    b: torch.Tensor,
    new_a: torch.Tensor,
    new_b: torch.Tensor,
    send: list[ExpertLoad],
    recv: list[ExpertLoad],
    n13: int,
    n2: int,
    world: int,
    group: dist.ProcessGroup | None,
) -> None:
    """One all_to_all_single carrying whole experts (w13 then w2, flattened)."""
    per = n13 + n2
    send.sort(key=lambda x: (x.rank, x.local_slot))  # the receiver's order
    recv.sort(key=lambda x: (x.source_rank, x.local_slot))
    in_splits = [0] * world
    out_splits = [0] * world
    rows = []
    for x in send:
        in_splits[x.rank] += per
        rows.append(torch.cat([a[x.source_local_slot].flatten(), b[x.source_local_slot].flatten()]))
    for x in recv:
        out_splits[x.source_rank] += per
    inp = torch.cat(rows) if rows else a.new_zeros(0)
    out = inp.new_empty(sum(out_splits))
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    out = out.to(a.device)
    for i, x in enumerate(recv):
        chunk = out[i * per : (i + 1) * per]
        new_a[x.local_slot] = chunk[:n13].view(new_a.shape[1:])
        new_b[x.local_slot] = chunk[n13:].view(new_b.shape[1:])
