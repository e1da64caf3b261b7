"""What the front-end's metrics and log take from each membership snapshot: the slots per
state, each rank's state changes (logged; failures and recoveries counted) and the
requests that resume on other ranks because theirs stopped taking them."""

from __future__ import annotations

import logging

from elasticep.frontend.metrics import FrontendMetrics
from elasticep.membership.status import DeploymentStatus
from elasticep.membership.transitions import SlotState

logger = logging.getLogger(__name__)


class SnapshotMetrics:
    """Observes the membership snapshots the front-end applies, in order.

    Args:
        metrics: the front-end's metrics, updated in place.
    """

    def __init__(self, metrics: FrontendMetrics) -> None:
        self.metrics = metrics
        self._states: dict[int, str] = {}
        self._ever_failed: set[int] = set()

    def observe(self, status: DeploymentStatus, states: dict[int, str],
                running: dict[int, int]) -> None:
        """Count one snapshot.

        Args:
            status: the snapshot.
            states: each rank's state as the front-end routes by it: the slot state's
                value, or ``"connecting"`` for a healthy rank it cannot reach yet.
            running: requests in flight per rank, before the snapshot moves any.
        """
        for entry in status.ranks:
            self._count_transition(entry.rank, entry.state, status.epoch)
        m = self.metrics
        m.ranks(status.ranks)
        m.epoch.set(status.epoch)
        for state in SlotState:
            m.slots.labels(state.value).set(sum(entry.state == state for entry in status.ranks))
        m.active_ranks.set(sum(s == SlotState.HEALTHY for s in states.values()))
        m.store_status(status.membership_store)
        for rank, n in running.items():
            state = states.get(rank)
            if n and state != SlotState.HEALTHY:
                cause = {SlotState.FAILED.value: "failure",
                         "connecting": "unreachable"}.get(state, "drain")
                m.requests_resumed.labels(cause).inc(n)

    def _count_transition(self, rank: int, state: SlotState, epoch: int) -> None:
        old = self._states.get(rank)
        if old == state:
            return
        self._states[rank] = state
        logger.info("epoch %d: rank %d %s -> %s", epoch, rank, old or "unknown", state)
        if state == SlotState.FAILED:
            self.metrics.rank_failures.inc()
            self._ever_failed.add(rank)
        elif state == SlotState.HEALTHY and rank in self._ever_failed:
            self._ever_failed.discard(rank)
            self.metrics.rank_recoveries.inc()
