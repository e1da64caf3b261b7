"""Placement changes the whole EP group agrees on: repair, admission, drain, rebalance.

Every change follows one pattern, so a failure in the middle never leaves ranks with
different placements:

1. agree on the membership with one all_reduce (MIN of the active masks: a rank that
   any survivor saw die is out for everyone);
2. compute the target placement, a pure function of (agreed mask, current placement)
   from :mod:`elasticep.eplb`, identical on every rank with no messages;
3. :func:`commit_placement`: plan (which slots need which expert from where, again pure
   and identical everywhere), move (weights from peers over ``all_to_all_single``,
   orphans from the checkpoint, into new tensors, leaving the executor untouched),
   commit (an all_reduce), swap (the executor to the new placement and tensors).

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
    ExpertLocationMetadata,
    Placement,
    broadcast_global_expert_location_metadata,
    initial_placement,
    plan_expert_loads,
    reconcile_placement,
    scale_down_placement,
)
from elasticep.moe.ep_executor import EPMoEExecutor
from elasticep.moe.weight_transfer import CheckpointLoader, move_expert_weights

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
        seconds: wall time of step 3 (plan, move, commit, swap).
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
    """Step 3: plan, move, commit, swap ``ep`` to ``new``. Collective: every live member
    of the group calls it with the same arguments but ``load_fn``.

    Args:
        ep: this rank's executor; its weights are laid out in ``ep.placement``.
        new: the target placement (from repair / scale / rebalance).
        group: the EP group, which carries the commit; it must be the executor's
            (``ep.group``), which carries the weight exchange.
        load_fn: checkpoint reader for the orphans this rank must host.
        source_ranks: [max_ep_size] bool, ranks that may send (default: active in both
            placements); a drain passes the old active ranks, so leaving ranks send.
        weights_from: the placement the current weights are laid out in, where it is not
            ``ep.placement`` (an all-EMPTY one: every weight is read anew).

    Raises:
        EpochChangedError (and subclasses): membership changed before the commit; the
            executor is unchanged.
        ValueError: this rank must read an orphan and has no ``load_fn`` (before any
            collective).
    """
    t0 = time.perf_counter()
    old = weights_from or ep.placement
    changed = new != ep.placement
    plan = plan_expert_loads(old, new, source_ranks)
    peers = ep.peer_weights
    departed0 = peers.departed_copies if peers is not None else 0
    try:
        w13, w2 = move_expert_weights(plan, old, new, ep.rank, ep.w13, ep.w2, ep.group,
                                      load_fn, peers)
        _commit(group)
    finally:
        if peers is not None:  # committed or not: the next change checks generations again
            peers.end_change()
    _swap(ep, new, w13, w2)
    mine = [x for x in plan if x.rank == ep.rank and w13[x.layer] is not None]
    departed = (peers.departed_copies if peers is not None else 0) - departed0
    return ChangeReport(
        changed=changed,
        peer_copies=sum(x.source_rank not in (None, ep.rank) for x in mine),
        reloads=sum(x.source_rank is None for x in mine) - departed,
        seconds=time.perf_counter() - t0,
        slots_per_rank=new.slots_per_rank,
        departed_copies=departed,
    )


def _commit(group: dist.ProcessGroup | None) -> None:
    """The commit point: every rank's weights arrived. A rank that died before it makes
    the all_reduce raise on every survivor, none of which has swapped (module docstring)."""
    flag = torch.ones(1, dtype=torch.int64)
    dist.all_reduce(flag, group=group)


def _swap(ep: EPMoEExecutor, new: Placement, w13: list[torch.Tensor | None],
          w2: list[torch.Tensor | None]) -> None:
    """Swap ``ep`` to ``new`` and the moved tensors, then publish its tensors to the host
    peers that map them, before this rank's next collective, so the next change maps
    the tensors now in use."""
    device = ep.metadata.physical_to_logical_map.device
    ep.set_placement(ExpertLocationMetadata.from_placement(new, ep.rank, device), w13, w2)
    if ep.peer_weights is not None:
        ep.peer_weights.publish(ep.w13, ep.w2)


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
