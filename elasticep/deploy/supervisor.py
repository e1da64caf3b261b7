"""The foreground loop of `serve` and `join`: watch this node's ranks until told to stop.

It applies the restart policy of ``--restart-failed-ranks``:

* a rank that exits with status 0 was removed on purpose (planned scale-down): never
  restarted, nor is any slot the coordinator marks ``removed``;
* any other exit (crash, SIGKILL, evicted) is relaunched in join mode ``recover``, at most
  ``max_restarts`` times per rank;
* a rank the coordinator evicted while its process is still alive (frozen) is killed
  first, so the relaunch does not race a zombie of itself.

Without the flag, exits are only logged.

A rank that exits while the coordinator is unreachable (it stops itself after the
heartbeat timeout: a partition, or node 0 gone) cannot be relaunched yet. With the flag,
:func:`supervise` keeps it and relaunches it in recover mode as soon as the coordinator
answers again; if the coordinator stays unreachable for ``coordinator_timeout_s`` while
none of this node's ranks runs, it raises :class:`CoordinatorUnreachableError`.

With ``--elastic-ep-backend none`` (``stop_on_exit``) there is no fault tolerance: the
first exit of a rank is fatal, and :func:`supervise` sets ``stop`` and returns at once so
that the caller stops the whole deployment.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections import Counter

from elasticep.deploy.deployment import Deployment
from elasticep.deploy.launcher import RankExit
from elasticep.elastic.exit_code import ExitCode
from elasticep.membership.transitions import SlotState

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


def recover_command(address: str, rank: int | list[int], node: int = 0) -> str:
    """The `join` command line that relaunches ``rank`` (or several) of the deployment
    whose coordinator is at ``address`` (``"host:port"``), from node ``node``: printed in
    logs so that pasting it works."""
    node_flag = f" --node-rank {node}" if node else ""
    ranks = ",".join(str(r) for r in ([rank] if isinstance(rank, int) else rank))
    return (f"elasticep join --dist-init-addr {address} --elastic-ep-join-mode recover "
            f"--ranks {ranks}{node_flag}")


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


def _world(dep: Deployment
           ) -> tuple[int, dict[int, SlotState], dict[int, int], dict[int, int]]:
    """(epoch, rank -> state, rank -> pid, rank -> node of its last launch) from the
    coordinator."""
    status = dep.deployment_status()
    return (status.epoch, status.states(), status.pids(),
            {r.rank: r.node for r in status.ranks})


def supervise(dep: Deployment, stop: threading.Event, restart: bool,
              until_all_exited: bool = False, max_restarts: int = 5,
              poll_s: float = 0.2, stop_on_exit: bool = False,
              coordinator_timeout_s: float = 60.0) -> list[RankExit]:
    """Watch this node's ranks of ``dep`` until ``stop`` is set.

    Args:
        dep: this node's share of the deployment.
        stop: set by a signal handler (or by the caller) to return.
        restart: relaunch crashed ranks (see module doc).
        until_all_exited: also return once no started worker is alive (``join``, and
            nodes other than 0: their ranks exit when the coordinator is gone).
        max_restarts: relaunches per rank before giving up on it.
        poll_s: loop period (seconds).
        stop_on_exit: the deployment has no fault tolerance (``--elastic-ep-backend
            none``): the first exit of a rank is logged as the reason, sets ``stop`` and
            returns; ``restart`` must be False.
        coordinator_timeout_s: with ``restart``, how long ranks that exited while the
            coordinator was unreachable wait for it (seconds; ``--coordinator-timeout``).

    Returns:
        Every exit seen, in order (with ``stop_on_exit``: the fatal one last).

    Raises:
        CoordinatorUnreachableError: with ``restart``, no rank of this node runs and the
            coordinator was unreachable for ``coordinator_timeout_s``.
    """
    if stop_on_exit and restart:
        raise ValueError("stop_on_exit and restart exclude each other")
    restarts: Counter[int] = Counter()
    seen: list[RankExit] = []
    deferred: list[int] = []  # exited while the coordinator was unreachable
    unreachable_since: float | None = None
    while not stop.wait(poll_s):
        try:
            epoch, states, coord_pids, nodes = _world(dep)
            if unreachable_since is not None:
                logger.info("node %d: the coordinator answers again (unreachable for %.1f s)",
                            dep.node, time.monotonic() - unreachable_since)
            unreachable_since = None
        except (ConnectionError, TimeoutError, OSError, ValueError) as exc:
            if unreachable_since is None:  # one line per outage, not one per poll
                unreachable_since = time.monotonic()
                logger.warning("node %d: coordinator unreachable (%s)", dep.node, exc)
            epoch, states, coord_pids, nodes = -1, {}, {}, {}
        while True:
            try:
                ex = dep.exits.get_nowait()
            except queue.Empty:
                break
            seen.append(ex)
            if stop_on_exit:
                logger.error("rank %d (pid %d) exited with %d; --elastic-ep-backend none has "
                             "no fault tolerance: stopping the deployment", ex.rank, ex.pid,
                             ex.code)
                stop.set()
                return seen
            if epoch < 0 and restart and ex.code != ExitCode.REMOVED:
                logger.warning("rank %d (pid %d) exited with %d while the coordinator is "
                               "unreachable; relaunching it when the coordinator answers "
                               "(up to %g s, --coordinator-timeout)", ex.rank, ex.pid,
                               ex.code, coordinator_timeout_s)
                deferred.append(ex.rank)
                continue
            _on_exit(dep, ex, epoch, states, restart, restarts, max_restarts)
        if restart:
            _kill_frozen(dep, epoch, states, coord_pids)
            if epoch >= 0:
                for rank in deferred:
                    _relaunch(dep, rank, epoch, "lost the coordinator", restarts,
                              max_restarts)
                deferred.clear()
                _adopt_failed(dep, epoch, states, coord_pids, nodes, restarts, max_restarts)
        # idle: no worker runs and every exit is in hand (one being reported to an
        # unreachable coordinator is not: returning then would miss it)
        idle = (bool(deferred) or until_all_exited) and not dep.watching() and dep.exits.empty()
        if (deferred and idle and unreachable_since is not None
                and time.monotonic() - unreachable_since > coordinator_timeout_s):
            raise CoordinatorUnreachableError(
                f"no coordinator answered at --dist-init-addr {dep.address} within "
                f"{coordinator_timeout_s:g} s (--coordinator-timeout)")
        if until_all_exited and idle and not deferred:
            break
    return seen


def _relaunch(dep: Deployment, rank: int, epoch: int, why: str, restarts: Counter[int],
              max_restarts: int) -> None:
    """Relaunch ``rank`` in recover mode, within its ``max_restarts`` budget."""
    if restarts[rank] >= max_restarts:
        logger.error("epoch %d: rank %d crashed %d times; not relaunching it again", epoch,
                     rank, restarts[rank])
        return
    restarts[rank] += 1
    logger.warning("epoch %d: rank %d %s; relaunching (restart %d)", epoch, rank, why,
                   restarts[rank])
    try:
        dep.relaunch(rank)
    except (ConnectionError, TimeoutError, OSError, ValueError) as exc:
        logger.warning("epoch %d: could not relaunch rank %d: %s", epoch, rank, exc)


def _on_exit(dep: Deployment, ex: RankExit, epoch: int, states: dict[int, str],
             restart: bool, restarts: Counter[int], max_restarts: int) -> None:
    if ex.code == ExitCode.REMOVED:
        logger.info("epoch %d: rank %d (pid %d) left after a planned removal", epoch, ex.rank,
                    ex.pid)
        return
    if states.get(ex.rank) == SlotState.FREE:  # never admitted: nothing to recover
        logger.info("epoch %d: rank %d (pid %d) exited with %d before it was admitted; its "
                    "slot is free capacity again", epoch, ex.rank, ex.pid, ex.code)
        return
    if epoch < 0:  # no hint: a relaunch needs the coordinator
        logger.warning("rank %d (pid %d) exited with %d while the coordinator is "
                       "unreachable", ex.rank, ex.pid, ex.code)
        return
    if not restart:
        logger.warning("epoch %d: rank %d (pid %d) exited with %d; relaunch it with `%s`",
                       epoch, ex.rank, ex.pid, ex.code,
                       recover_command(dep.address, ex.rank, dep.node))
        return
    _relaunch(dep, ex.rank, epoch, f"(pid {ex.pid}) exited with {ex.code}", restarts,
              max_restarts)


def _adopt_failed(dep: Deployment, epoch: int, states: dict[int, SlotState],
                  coord_pids: dict[int, int], nodes: dict[int, int],
                  restarts: Counter[int], max_restarts: int) -> None:
    """Relaunch the failed ranks of this node that another launcher started (a `join`
    recovered them): a rank of the node is restarted whoever launched it. Our own
    ranks are left to their exit (the coordinator's pid for the slot is ours)."""
    ours, running = dep.pids(live_only=False), dep.pids(live_only=True)
    for rank, state in states.items():
        pid = coord_pids.get(rank)
        # a live worker of ours holds the slot: one relaunched in this very iteration
        # (``states`` predates it) or a frozen one (_kill_frozen's)
        if (state != SlotState.FAILED or nodes.get(rank) != dep.node or pid is None
                or ours.get(rank) == pid or rank in running
                or restarts[rank] >= max_restarts):
            continue
        _relaunch(dep, rank, epoch, f"(pid {pid}, started by another launcher on this node) "
                  "failed", restarts, max_restarts)


def _kill_frozen(dep: Deployment, epoch: int, states: dict[int, str],
                 coord_pids: dict[int, int]) -> None:
    """Kill our workers the coordinator evicted but that are still alive (frozen)."""
    for rank, pid in dep.pids(live_only=True).items():
        if states.get(rank) == SlotState.FAILED and coord_pids.get(rank) == pid:
            logger.warning("epoch %d: rank %d (pid %d) was evicted but is alive; killing it",
                           epoch, rank, pid)
            dep.kill(rank)
