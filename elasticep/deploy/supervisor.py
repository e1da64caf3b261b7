"""The foreground loop of `serve` and `join`: watch this node's ranks until told to stop.

Each poll it looks at the coordinator and at this node's workers, hands that and the
exits since the last poll to the pure ``restart_policy.decide`` (the rules of
``--restart-failed-ranks`` are written there), and carries out the actions it returns:
kill a frozen worker, relaunch a rank, or stop the deployment.

A rank that exits while the coordinator is unreachable (it stops itself after the
heartbeat timeout: a partition, or node 0 gone) cannot be relaunched yet. With
:attr:`OnExit.RELAUNCH`, :func:`supervise` keeps it and relaunches it in recover mode as
soon as the coordinator answers again; if the coordinator stays unreachable for
``coordinator_timeout_s`` while none of this node's ranks runs, it raises
:class:`CoordinatorUnreachableError`.

With ``--elastic-ep-backend none`` (:attr:`OnExit.STOP`) there is no fault tolerance:
the first exit of a rank is fatal, and :func:`supervise` sets ``stop`` and returns at
once so that the caller stops the whole deployment.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections.abc import Callable

from elasticep.deploy.deployment import Deployment
from elasticep.deploy.launcher import RankExit
from elasticep.deploy.restart_policy import (
    ActionKind,
    End,
    Ledger,
    OnExit,
    Policy,
    View,
    World,
    decide,
    ending,
)
from elasticep.elastic.exit_code import ExitCode

logger = logging.getLogger(__name__)


class CoordinatorUnreachableError(ConnectionError):
    """The coordinator stayed unreachable for ``--coordinator-timeout`` while this node's
    ranks were stopped and waiting to be relaunched."""


class StopEvent(threading.Event):
    """Set when the command is told to stop; ``signum`` is the signal that did it."""

    signum: int | None = None

    def exit_status(self) -> int | None:
        """128 + the signal number (130 for Ctrl-C, 143 for SIGTERM) as shells report a
        command ended by a signal; None if no signal stopped it."""
        return None if self.signum is None else 128 + self.signum


def stop_on_signals() -> StopEvent:
    """An event set by SIGINT (Ctrl-C) or SIGTERM; call from the main thread."""
    stop = StopEvent()

    def handler(signum: int, _frame: object) -> None:
        logger.info("received %s; stopping", signal.Signals(signum).name)
        if stop.signum is None:
            stop.signum = signum
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def exit_status(wanted: int, joined: int, exits: list[RankExit], stop: StopEvent) -> int:
    """The exit status of a command that watched its ranks (`join`, nodes 1.. of serve).

    Args:
        wanted: ranks it started.
        joined: of those, the ranks that got in.
        exits: every exit it saw (:func:`supervise`'s list).
        stop: its stop event.

    Returns:
        1 if a rank was lost (it died before it got in, or exited with anything but
        the planned-removal status 0, a signal included); else 128 + the signal that
        stopped the command (130 for Ctrl-C); else 0.
    """
    if joined < wanted or any(ex.code != ExitCode.REMOVED for ex in exits):
        return 1
    return stop.exit_status() or 0


def _world(dep: Deployment) -> World:
    """The coordinator's view. Raises ConnectionError, TimeoutError, OSError or
    ValueError when it does not answer."""
    status = dep.deployment_status()
    return World(status.epoch, status.states(), status.pids(),
                 {r.rank: r.node for r in status.ranks})


def _drain(exits: queue.Queue, most: int | None) -> list[RankExit]:
    """The queued exits, at most ``most`` of them (None: all)."""
    out: list[RankExit] = []
    while most is None or len(out) < most:
        try:
            out.append(exits.get_nowait())
        except queue.Empty:
            break
    return out


def supervise(dep: Deployment, stop: threading.Event, policy: Policy = Policy(),
              poll_s: float = 0.2,
              on_look: Callable[[Ledger, float], None] | None = None) -> list[RankExit]:
    """Watch this node's ranks of ``dep`` until ``stop`` is set.

    Args:
        dep: this node's share of the deployment.
        stop: set by a signal handler (or by the caller) to return.
        policy: the restart policy (``restart_policy.Policy``): what an exit leads to,
            whether to return once no worker of this node runs (``join``, and nodes
            other than 0: their ranks exit when the coordinator is gone), the restart
            budget and the coordinator timeout.
        poll_s: loop period (seconds).
        on_look: called after each look with the ledger and the time (monotonic
            seconds), e.g. to show the restart budget.

    Returns:
        Every exit seen, in order (with ``OnExit.STOP``: the fatal one last).

    Raises:
        CoordinatorUnreachableError: with ``OnExit.RELAUNCH``, no rank of this node runs
            and the coordinator was unreachable for ``policy.coordinator_timeout_s``.
    """
    ledger = Ledger()
    seen: list[RankExit] = []
    unreachable_since: float | None = None
    while not stop.wait(poll_s):
        try:
            world: World | None = _world(dep)
            if unreachable_since is not None:
                logger.info("node %d: the coordinator answers again (unreachable for %.1f s)",
                            dep.node, time.monotonic() - unreachable_since)
            unreachable_since = None
        except (ConnectionError, TimeoutError, OSError, ValueError) as exc:
            if unreachable_since is None:  # one line per outage, not one per poll
                unreachable_since = time.monotonic()
                logger.warning("node %d: coordinator unreachable (%s)", dep.node, exc)
            world = None
        # the first exit is fatal without fault tolerance: the later ones stay queued
        exits = _drain(dep.exits, 1 if policy.on_exit == OnExit.STOP else None)
        seen += exits
        now = time.monotonic()
        view = View(dep.node, dep.address, world, dep.pids(live_only=False),
                    dep.pids(live_only=True), now)
        actions, ledger = decide(view, exits, policy, ledger)
        if on_look is not None:
            on_look(ledger, now)
        for action in actions:
            if action.kind == ActionKind.STOP:
                stop.set()
                return seen
            if action.kind == ActionKind.KILL:
                dep.kill(action.rank)
            else:
                _relaunch(dep, action.rank, world.epoch)
        # idle: no worker runs and every exit is in hand (one being reported to an
        # unreachable coordinator is not: returning then would miss it)
        end = ending(policy, ledger, lambda: not dep.watching() and dep.exits.empty(),
                     None if unreachable_since is None
                     else time.monotonic() - unreachable_since)
        if end == End.GIVE_UP:
            raise CoordinatorUnreachableError(
                f"no coordinator answered at --dist-init-addr {dep.address} within "
                f"{policy.coordinator_timeout_s:g} s (--coordinator-timeout)")
        if end == End.DONE:
            break
    return seen


def _relaunch(dep: Deployment, rank: int, epoch: int) -> None:
    try:
        dep.relaunch(rank)
    except (ConnectionError, TimeoutError, OSError, ValueError) as exc:
        logger.warning("epoch %d: could not relaunch rank %d: %s", epoch, rank, exc)
