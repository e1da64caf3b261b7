"""The joiner's side of an admission: become a member, then take the placement and the
experts as the survivors hand them over (their side is the step loop's admission)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

import elasticep.distributed as ed
from elasticep.elastic import placement_sync
from elasticep.moe.ep_executor import EPMoEExecutor
from elasticep.moe.weight_transfer import CheckpointLoader

logger = logging.getLogger(__name__)


def join_as_new_rank(ep: EPMoEExecutor, group: dist.ProcessGroup | None,
                     load_fn: CheckpointLoader | None, timeout_s: float,
                     on_member: Callable[[], object] | None = None,
                     ) -> placement_sync.ChangeReport:
    """Joiner side of an admission: block in ``join_group``, then run the same first ops
    as the survivors (:func:`placement_sync.share_placement`, then
    :func:`placement_sync.reconcile`).

    A member that dies during the hand-over or the expert transfer makes the survivors
    abandon the admission and recover onto the new membership (`LockstepLoop._recover`:
    share the placement again, then reconcile); the joiner does the same instead of
    dying with them. If every rank had died (the coordinator admitted the ready joiners
    itself), nobody shares a placement and the joiners rebuild it from the checkpoint
    (:func:`placement_sync.rebuild`); if the last member dies after the hand-over,
    :func:`placement_sync.reconcile` reads every expert from the checkpoint too.

    ``on_member`` runs as soon as ``join_group`` returns: the rank is a member from then
    on (the coordinator shows it healthy), before the placement and experts arrive.

    Raises:
        TimeoutError: not admitted within ``timeout_s``.
        RankEvictedError: this rank left the group meanwhile.
    """
    ed.join_group(group, timeout_s=timeout_s)
    if on_member is not None:
        on_member()
    holds = False  # this joiner holds the survivors' placement
    while True:
        try:
            # False: every rank had died, and all members are joiners with nothing to share
            holds = placement_sync.share_placement(ep, holds, group) or holds
            settle = placement_sync.reconcile if holds else placement_sync.rebuild
            return settle(ep, ed.get_active_ranks(group).to(torch.bool), group, load_fn)
        except ed.RankEvictedError:
            raise
        except ed.EpochChangedError as exc:
            logger.warning("admission interrupted (%s); reconciling over ranks %s", exc,
                           ed.get_active_ranks(group).nonzero().flatten().tolist())
