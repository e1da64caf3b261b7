"""Placement changes the whole EP group agrees on: repair, admission, drain, rebalance.

Every change follows one pattern, so a failure in the middle never leaves ranks with
different placements:

1. agree on the membership with one all_reduce (MIN of the active masks: a rank that
   any survivor saw die is out for everyone);
2. compute the target placement, a pure function of (agreed mask, current placement)
   from :mod:`elasticep.eplb`, identical on every rank with no messages;
3. fetch weights (peers over ``all_to_all_single``, orphans from the checkpoint) into
   new tensors, leaving the executor untouched;
4. a "commit" all_reduce, then swap the executor to the new placement.

If a rank dies before the commit, every survivor raises (the exchange cannot be
redone), none has swapped, and the caller runs the change again on the new membership.
If the commit completed anywhere, the elastic group hands its result to every
survivor, so all of them swap.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elasticep.eplb import (
    Placement,
    broadcast_global_expert_location_metadata,
    initial_placement,
    reconcile_placement,
    scale_down_placement,
)
from elasticep.moe.ep_executor import EPMoEExecutor
from elasticep.moe.weight_transfer import CheckpointLoader

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChangeReport:
    """What one placement change did (for logs, metrics and bench/ep.py).

    Attributes:
        changed: the placement differs from the old one.
        peer_copies: expert slots filled from another rank.
        reloads: expert slots filled from the checkpoint (orphans) by this rank.
        departed_copies: orphans this rank copied from a dead rank's still-mapped
            memory instead (ranks of one host, :class:`~elasticep.moe.peer_weights.PeerWeights`).
        seconds: wall time of steps 1-4.
        slots_per_rank: after the change.
    """

    changed: bool
    peer_copies: int
    reloads: int
    seconds: float
    slots_per_rank: int
    departed_copies: int = 0


def agree_active_mask(local_mask: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """MIN over ranks of the local active masks.

    Args:
        local_mask: [max_ep_size] int/bool, this rank's view (1 = active).
        group: the EP group.

    Returns:
        [max_ep_size] bool, identical on every rank that returns.
    """
    m = local_mask.to(torch.int64).clone()
    dist.all_reduce(m, op=dist.ReduceOp.MIN, group=group)
    return m.to(torch.bool)


def commit_placement(ep: EPMoEExecutor, new: Placement, group: dist.ProcessGroup | None,
                     load_fn: CheckpointLoader | None,
                     source_ranks: torch.Tensor | None = None,
                     weights_from: Placement | None = None) -> ChangeReport:
    """Steps 3-4: fetch weights for ``new``, commit all_reduce, swap. Collective.

    The only caller of :meth:`EPMoEExecutor.apply_placement` in the serving path: it
    supplies the commit point that the executor leaves to its caller.

    Args:
        group: the EP group, which carries the commit; it must be the executor's
            (``ep.group``), which carries the weight exchange.

    Raises:
        EpochChangedError (and subclasses): membership changed before the commit; the
            executor is unchanged.
    """
    t0 = time.perf_counter()
    old = ep.placement

    def commit() -> None:
        flag = torch.ones(1, dtype=torch.int64)
        dist.all_reduce(flag, group=group)  # the commit point (see module docstring)

    peers = ep.peer_weights
    departed0 = peers.departed_copies if peers is not None else 0
    loads = ep.apply_placement(new, load_fn, source_ranks, commit=commit,
                               weights_from=weights_from)
    mine = [x for x in loads if x.rank == ep.rank]
    departed = (peers.departed_copies if peers is not None else 0) - departed0
    return ChangeReport(
        changed=new != old,
        peer_copies=sum(x.source_rank not in (None, ep.rank) for x in mine),
        reloads=sum(x.source_rank is None for x in mine) - departed,
        seconds=time.perf_counter() - t0,
        slots_per_rank=new.slots_per_rank,
        departed_copies=departed,
    )


def reconcile(ep: EPMoEExecutor, local_mask: torch.Tensor, group: dist.ProcessGroup | None,
              load_fn: CheckpointLoader | None) -> ChangeReport:
    """After a failure (or any membership change): agree on the mask, repair, commit.

    Ranks that left lose their slots (orphans re-homed, reloaded from the checkpoint);
    ranks that joined get replicas. Collective over the survivors. If no member of the
    placement is left (the last survivor died right after handing it to joiners), the
    joiners start over from the checkpoint as :func:`rebuild` does.
    """
    mask = agree_active_mask(local_mask, group)
    if not bool((mask & ep.placement.active_ranks).any()):
        logger.warning("no live rank holds an expert (every member of the placement died): "
                       "reading all of them from the checkpoint over ranks %s",
                       torch.nonzero(mask).flatten().tolist())
        return _from_checkpoint(ep, mask, group, load_fn)
    new = reconcile_placement(ep.placement, mask)
    return commit_placement(ep, new, group, load_fn)


def share_placement(ep: EPMoEExecutor, has_placement: bool,
                    group: dist.ProcessGroup | None) -> bool:
    """First op of an admission, run by survivors and joiners alike; :func:`reconcile`
    onto the new mask follows (it copies replicas to the joiners from peers).
    Collective over survivors and joiners.

    The survivors' placement is broadcast from the lowest rank that holds one (never a
    joiner; not rank 0 unless it is that rank), so joiners learn it and size their
    (empty) slots to it.

    Args:
        has_placement: False on a joiner (its executor's placement is a stand-in).

    Returns:
        False if no member holds a placement (every rank had died: all are joiners,
        whose executors keep their stand-in; see :func:`rebuild`).

    Raises:
        EpochChangedError (and subclasses): membership changed; a joiner then has no
            placement and cannot follow the survivors' recovery.
    """
    holders = torch.zeros(ep.placement.max_ep_size, dtype=torch.int64)
    holders[ep.rank] = int(has_placement)
    dist.all_reduce(holders, group=group)
    if not bool(holders.any()):
        logger.warning("no member holds a placement: rebuilding from the checkpoint")
        return False
    src = int(torch.nonzero(holders).flatten()[0])
    meta = broadcast_global_expert_location_metadata(
        ep.metadata if has_placement else None, src, group, ep.rank,
        ep.metadata.physical_to_logical_map.device)
    if not has_placement:
        S = meta.num_local_physical_experts
        ep.set_placement(meta, [None if a is None else a.new_zeros(S, *a.shape[1:]) for a in ep.w13],
                         [None if b is None else b.new_zeros(S, *b.shape[1:]) for b in ep.w2])
    logger.info("placement broadcast from rank %d", src)
    return True


def rebuild(ep: EPMoEExecutor, local_mask: torch.Tensor, group: dist.ProcessGroup | None,
            load_fn: CheckpointLoader | None) -> ChangeReport:
    """Start over after every rank died: the launch placement (the stand-in each joiner
    built from the same deployment config) repaired onto the agreed mask, with every
    expert read from the checkpoint. Collective over the (all-joiner) group.

    Raises:
        EpochChangedError (and subclasses): membership changed; the executor is unchanged.
    """
    return _from_checkpoint(ep, agree_active_mask(local_mask, group), group, load_fn)


def _from_checkpoint(ep: EPMoEExecutor, mask: torch.Tensor, group: dist.ProcessGroup | None,
                     load_fn: CheckpointLoader | None) -> ChangeReport:
    """Commit a placement over the agreed ``mask`` with every expert read from the
    checkpoint: the current one repaired onto ``mask`` when some of its ranks are in it
    (a joiner's stand-in is the launch placement), else a launch-style layout over
    ``mask`` with as many slots per rank (scale joiners whose whole cohort died)."""
    old = ep.placement
    if bool((mask & old.active_ranks).any()):
        new = reconcile_placement(old, mask)
    else:
        k, E = int(mask.sum()), old.num_logical_experts
        new = initial_placement(old.num_layers, E, max(0, old.slots_per_rank * k - E), k,
                                old.max_ep_size, mask)
    nothing = Placement(torch.full_like(old.phy2log, old.empty), old.num_logical_experts,
                        old.slots_per_rank, torch.zeros_like(old.active_ranks))
    # No rank of `nothing` is active, so no rank is a source: all from the checkpoint.
    return commit_placement(ep, new, group, load_fn, weights_from=nothing)


def drain(ep: EPMoEExecutor, leaving: list[int], group: dist.ProcessGroup | None) -> ChangeReport:
    """Planned removal: move experts off ``leaving`` (they still send), commit. Collective
    over every active rank, the leaving ones included; call ``deactivate_ranks`` after."""
    old = ep.placement
    new = scale_down_placement(old, leaving)
    return commit_placement(ep, new, group, None, source_ranks=old.active_ranks)
