"""The front-end's membership watcher: polls :class:`MembershipSource` every
``membership_poll_s`` seconds (in a thread, with a timeout) and applies rank state
changes, which moves requests off failed/draining/free slots.

A mixin of :class:`~elasticep.frontend.core.Frontend`. While the coordinator cannot be
reached (a leader change, a partition) every poll fails; :class:`SnapshotOutage` logs
such a run once when it starts and once when it ends, not once a poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from elasticep.frontend.membership_metrics import SnapshotMetrics
from elasticep.frontend.membership_source import MembershipSource
from elasticep.frontend.metrics import FrontendMetrics
from elasticep.frontend.recovery_timeline import Event, RecoveryTimeline
from elasticep.frontend.request_tracker import RequestTracker, SendToRank
from elasticep.frontend_link import FrontendChannel, is_routable
from elasticep.membership.status import DeploymentStatus
from elasticep.membership.transitions import SlotState

if TYPE_CHECKING:  # core imports this module
    from elasticep.frontend.core import FrontendConfig

logger = logging.getLogger(__name__)


class SnapshotOutage:
    """A run of failed membership snapshots, logged as two lines: a warning when the
    first fails (with its reason) and an info line when one succeeds again (with how
    long, in seconds, and how many polls failed).

    Args:
        clock: monotonic seconds (injected so tests need no sleeps).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: float | None = None  # when the current run of failures began
        self._failures = 0

    def failed(self, epoch: int, exc: BaseException) -> None:
        """One snapshot failed at ``epoch`` (the last known view's) with ``exc``."""
        self._failures += 1
        if self._since is None:
            self._since = self._clock()
            logger.warning("epoch %s: membership snapshot failed: %r; serving on the last "
                           "known view, next line when a snapshot succeeds", epoch, exc)

    def succeeded(self, epoch: int) -> None:
        """A snapshot succeeded; ends the current run of failures, if any."""
        if self._since is None:
            return
        logger.info("epoch %s: membership snapshots succeed again after %.1f s "
                    "(%d polls failed)", epoch, self._clock() - self._since, self._failures)
        self._since, self._failures = None, 0


class MembershipWatch:
    """The membership half of :class:`~elasticep.frontend.core.Frontend`."""

    channel: FrontendChannel
    membership: MembershipSource
    metrics: FrontendMetrics
    tracker: RequestTracker
    timeline: RecoveryTimeline
    config: FrontendConfig
    _status: DeploymentStatus
    _snapshots: SnapshotMetrics
    _outage: SnapshotOutage
    _unreachable: set[int]
    _wake_membership: asyncio.Event
    _ready: bool
    _dispatch: Callable[[list[SendToRank]], None]
    _record: Callable[[list[Event]], None]

    async def refresh_membership(self) -> None:
        """Fetch a membership snapshot now and apply it (errors are logged, not raised:
        once when they start and once when snapshots succeed again, see
        :class:`SnapshotOutage`)."""
        try:
            status = await asyncio.wait_for(asyncio.to_thread(self.membership.status),
                                            self.config.status_timeout_s)
        except Exception as exc:  # noqa: BLE001 - keep serving on the last known view
            self._outage.failed(self._status.epoch, exc)
            return
        self._outage.succeeded(self._status.epoch)
        self._apply_status(status)

    def _apply_status(self, status: DeploymentStatus) -> None:
        self._status = status
        states: dict[int, str] = {}
        for entry in status.ranks:
            rank, state, pid = entry.rank, entry.state, entry.pid
            routable = (is_routable(state, pid, self.channel.connected.get(rank))
                        and rank not in self._unreachable)
            # A healthy rank whose worker we cannot reach yet is not routable.
            states[rank] = ("connecting" if state == SlotState.HEALTHY and not routable
                            else state.value)
        # before update_ranks moves the requests of ranks that stop taking them
        self._snapshots.observe(status, states, self.tracker.running_per_rank())
        self._record(self.timeline.on_status(time.monotonic(), status))
        before = self.tracker.resubmitted_total
        # each rank's own limit, from its latest hello (engine.limits)
        self._dispatch(self.tracker.set_capacity(
            {r: h.max_running_requests for r, h in self.channel.connected.items()
             if h.max_running_requests is not None}))
        self._dispatch(self.tracker.update_ranks(states))
        if not self._ready and status.ep_size > 0:
            self._ready = len(self.tracker.healthy_ranks()) >= status.ep_size
        self.metrics.resubmitted_requests.inc(self.tracker.resubmitted_total - before)

    async def _watch_membership(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake_membership.wait(),
                                       self.config.membership_poll_s)
            self._wake_membership.clear()
            await self.refresh_membership()
