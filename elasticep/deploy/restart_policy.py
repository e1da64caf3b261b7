"""The restart policy of `serve` and `join` as pure decisions (no processes, no clock).

:func:`decide` takes one look at the node (:class:`View`: the coordinator's world, or
None while it does not answer, and this node's worker pids), the exits seen since the
last look, the :class:`Policy` and what the loop remembers (:class:`Ledger`), and
returns the :class:`Action` list to carry out in order and the new ledger.
:func:`ending` says whether the loop is done once they are carried out. The loop
that does the I/O is ``supervisor.supervise``.

The rules (``--restart-failed-ranks`` is :attr:`OnExit.RELAUNCH`):

* a rank that exits with status 0 was removed on purpose (planned scale-down): never
  restarted, nor is any slot the coordinator marks free;
* any other exit (crash, SIGKILL, evicted) is relaunched in join mode ``recover``, at
  most ``max_restarts`` times per rank within any ``restart_window_s`` (a rate, as a
  pod's restarts: a rank that crashes once a day is always relaunched, one in a crash
  loop waits until its oldest relaunch in the window ages out); one that exits while
  the coordinator does not answer waits for it (deferred);
* a rank the coordinator evicted while its process is still alive (frozen) is killed
  first, so the relaunch does not race a zombie of itself;
* a failed rank of this node that another launcher started (a `join`) is relaunched too;
* with :attr:`OnExit.LOG` exits are only logged (with the `join` command that
  relaunches them); with :attr:`OnExit.STOP` (``--elastic-ep-backend none``) the first
  exit stops the deployment;
* with a membership store (:attr:`Policy.rejoin_lost`, ``--membership-store etcd://``)
  a rank that exits with :attr:`ExitCode.LOST` is relaunched as with RELAUNCH, even
  under LOG: the membership failed it while its process was sound (its node was cut
  off from the leader and etcd's majority, or it lost every coordinator for its stall
  grace), so once the node is back in quorum it rejoins its slot, within the same
  budget; a crash is still only logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from elasticep.deploy.launcher import RankExit
from elasticep.elastic.exit_code import ExitCode
from elasticep.enums import StrEnum
from elasticep.membership.transitions import SlotState

logger = logging.getLogger("elasticep.deploy.supervisor")


class OnExit(StrEnum):
    """What an exit of a rank leads to."""

    LOG = "log"            # logged with the command that relaunches it
    RELAUNCH = "relaunch"  # --restart-failed-ranks
    STOP = "stop"          # --elastic-ep-backend none: no fault tolerance


class Until(StrEnum):
    """When the loop returns besides a set stop event."""

    STOPPED = "stopped"        # only when told to stop (serve's node 0)
    ALL_EXITED = "all_exited"  # also once no worker of this node runs (join, nodes 1..)


class ActionKind(StrEnum):
    """What one :class:`Action` does."""

    STOP = "stop"          # set the stop event and return: the deployment must stop
    KILL = "kill"          # kill our live worker of ``rank`` (evicted but frozen)
    RELAUNCH = "relaunch"  # relaunch ``rank`` in join mode recover


class End(StrEnum):
    """Why the loop ends (see :func:`ending`)."""

    DONE = "done"        # Until.ALL_EXITED and nothing of this node runs
    GIVE_UP = "give_up"  # the coordinator stayed unreachable too long


def on_exit_for(restart: bool, fault_tolerant: bool = True) -> OnExit:
    """The :class:`OnExit` of the command-line flags.

    Args:
        restart: ``--restart-failed-ranks``.
        fault_tolerant: the backend survives a rank's death (not ``none``).

    Raises:
        ValueError: ``restart`` without fault tolerance.
    """
    if not fault_tolerant:
        if restart:
            raise ValueError("a deployment without fault tolerance cannot restart ranks")
        return OnExit.STOP
    return OnExit.RELAUNCH if restart else OnExit.LOG


@dataclass(frozen=True)
class Policy:
    """The restart policy (the flags of ``serve`` / ``join``).

    Attributes:
        on_exit: what a rank's exit leads to.
        until: when the loop returns.
        max_restarts: relaunches per rank within ``restart_window_s`` (``--max-restarts``);
            a rank over it waits until its oldest relaunch leaves the window.
        restart_window_s: the window of that budget (seconds; ``--restart-window``).
        coordinator_timeout_s: with RELAUNCH, how long ranks that exited while the
            coordinator was unreachable wait for it (seconds; ``--coordinator-timeout``).
        rejoin_lost: relaunch ranks that exit with :attr:`ExitCode.LOST` under LOG too
            (a deployment with standby coordinators: see the module docstring).
    """

    on_exit: OnExit = OnExit.LOG
    until: Until = Until.STOPPED
    max_restarts: int = 5
    restart_window_s: float = 600.0
    coordinator_timeout_s: float = 60.0
    rejoin_lost: bool = False

    def relaunches(self, code: int) -> bool:
        """Whether an exit with ``code`` is relaunched."""
        return self.on_exit == OnExit.RELAUNCH or (
            self.rejoin_lost and self.on_exit == OnExit.LOG and code == ExitCode.LOST)

    def budget(self) -> dict[str, float]:
        """The budget as ``/elastic_ep_status`` shows it."""
        return {"max_restarts": self.max_restarts, "restart_window_s": self.restart_window_s}


@dataclass(frozen=True)
class World:
    """The coordinator's answer: its epoch and, per rank, the slot state, the pid it
    recorded and the node of the rank's last launch."""

    epoch: int
    states: Mapping[int, SlotState]
    pids: Mapping[int, int]
    nodes: Mapping[int, int]


@dataclass(frozen=True)
class View:
    """One look at the node.

    Attributes:
        node: this node's rank.
        address: the coordinator's ``host:port`` (for the relaunch hint).
        world: the coordinator's view, or None if it did not answer.
        ours: rank -> pid of the latest worker started here for it.
        running: rank -> pid of those still alive.
        now: the time of the look (monotonic seconds), for the restart budget.
    """

    node: int
    address: str
    world: World | None
    ours: Mapping[int, int] = field(default_factory=dict)
    running: Mapping[int, int] = field(default_factory=dict)
    now: float = 0.0


@dataclass(frozen=True)
class Ledger:
    """What the loop remembers between looks: per rank, the times of its relaunches
    still inside the restart window; the ranks that exited while the coordinator did
    not answer (relaunched once it does); the ranks over their budget (relaunched once
    it allows); and rank -> pid of each worker of ours seen as a member (healthy), so an
    exit is never called one "before it was admitted" once it was."""

    restarts: Mapping[int, tuple[float, ...]] = field(default_factory=dict)
    deferred: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    admitted: Mapping[int, int] = field(default_factory=dict)

    def recent(self, now: float, window_s: float) -> dict[int, int]:
        """rank -> relaunches within the last ``window_s`` seconds before ``now``."""
        counts = {r: sum(now - t < window_s for t in ts) for r, ts in self.restarts.items()}
        return {r: n for r, n in counts.items() if n}


@dataclass(frozen=True)
class Action:
    """One thing for the loop to do to rank ``rank`` (``why``: for its log line)."""

    kind: ActionKind
    rank: int
    why: str = ""


def restart_budget(policy: Policy, ledger: Ledger, now: float) -> dict:
    """The restart budget as ``/elastic_ep_status`` shows it: the flags, and per rank
    the relaunches inside the window and whether it waits for the budget."""
    return {**policy.budget(), "enabled": policy.on_exit == OnExit.RELAUNCH,
            "rejoin_lost": policy.rejoin_lost and policy.on_exit == OnExit.LOG,
            "recent_restarts": {str(r): n for r, n in
                                sorted(ledger.recent(now, policy.restart_window_s).items())},
            "waiting_for_budget": sorted(ledger.waiting)}


def recover_command(address: str, rank: int | list[int], node: int = 0) -> str:
    """The `join` command line that relaunches ``rank`` (or several) of the deployment
    whose coordinator is at ``address`` (``"host:port"``), from node ``node``: printed in
    logs so that pasting it works."""
    node_flag = f" --node-rank {node}" if node else ""
    ranks = ",".join(str(r) for r in ([rank] if isinstance(rank, int) else rank))
    return (f"elasticep join --dist-init-addr {address} --elastic-ep-join-mode recover "
            f"--ranks {ranks}{node_flag}")


def scale_command(address: str, ranks: list[int], node: int = 0) -> str:
    """The `join` command line that starts the joiners a grow waits for (slots
    ``ranks``) on node ``node``, for the deployment whose coordinator is at
    ``address``."""
    node_flag = f" --node-rank {node}" if node else ""
    return (f"elasticep join --dist-init-addr {address} --elastic-ep-join-mode scale "
            f"--ranks {','.join(str(r) for r in ranks)}{node_flag}")


def decide(view: View, exits: Sequence[RankExit], policy: Policy,
           ledger: Ledger) -> tuple[list[Action], Ledger]:
    """The actions for one look at the node, in the order to carry them out.

    Args:
        view: the node and the coordinator's world as seen now.
        exits: the rank exits seen since the previous look, in order.
        policy: the restart policy.
        ledger: what the previous look left.

    Returns:
        (actions, the ledger for the next look). A STOP action is the last one.
    """
    plan = _Plan(view, policy, {r: tuple(t for t in ts if view.now - t < policy.restart_window_s)
                                for r, ts in ledger.restarts.items()})
    plan.waiting = list(ledger.waiting)
    plan.admitted = dict(ledger.admitted)
    plan.see_members()
    deferred = list(ledger.deferred)
    world = view.world
    relaunching = policy.on_exit == OnExit.RELAUNCH
    for ex in exits:
        if policy.on_exit == OnExit.STOP:
            logger.error("rank %d (pid %d) exited with %d; --elastic-ep-backend none has "
                         "no fault tolerance: stopping the deployment", ex.rank, ex.pid,
                         ex.code)
            plan.actions.append(Action(ActionKind.STOP, ex.rank))
            return plan.actions, plan.ledger(deferred)
        if world is None and policy.relaunches(ex.code) and ex.code != ExitCode.REMOVED:
            logger.warning("rank %d (pid %d) exited with %d while the coordinator is "
                           "unreachable; relaunching it when the coordinator answers (%s)",
                           ex.rank, ex.pid, ex.code,
                           f"up to {policy.coordinator_timeout_s:g} s, --coordinator-timeout"
                           if relaunching else "this node is cut off from the leader and "
                           "etcd's majority: whenever it is back in quorum")
            deferred.append(ex.rank)
            continue
        plan.on_exit(ex)
    if relaunching:
        plan.kill_frozen()
    if world is not None:
        for rank in deferred:
            plan.relaunch(rank, "lost the coordinator")
        deferred.clear()
        plan.retry_waiting()
        if relaunching:
            plan.adopt_failed()
    return plan.actions, plan.ledger(deferred)


def ending(policy: Policy, ledger: Ledger, idle: Callable[[], bool],
           unreachable_for_s: float | None) -> End | None:
    """Whether the loop is done after carrying out a look's actions.

    Args:
        idle: says whether no worker of this node runs and every exit is in hand;
            called only when the answer matters.
        unreachable_for_s: how long the coordinator has not answered (seconds), or None
            if it answered at the last look.

    Returns:
        GIVE_UP: with RELAUNCH, ranks wait for a coordinator unreachable past the
        timeout; DONE: the policy returns once all exited and they have; None: go on.
    """
    idle = (bool(ledger.deferred) or policy.until == Until.ALL_EXITED) and idle()
    # ranks the membership failed (rejoin_lost) wait for quorum however long it takes
    if (ledger.deferred and idle and unreachable_for_s is not None
            and unreachable_for_s > policy.coordinator_timeout_s
            and policy.on_exit == OnExit.RELAUNCH):
        return End.GIVE_UP
    if policy.until == Until.ALL_EXITED and idle and not ledger.deferred:
        return End.DONE
    return None


@dataclass
class _Plan:
    """The actions of one look being built (see :func:`decide`)."""

    view: View
    policy: Policy
    restarts: dict[int, tuple[float, ...]]
    actions: list[Action] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    admitted: dict[int, int] = field(default_factory=dict)

    def ledger(self, deferred: list[int]) -> Ledger:
        return Ledger({r: ts for r, ts in self.restarts.items() if ts}, tuple(deferred),
                      tuple(self.waiting), dict(self.admitted))

    def see_members(self) -> None:
        """Note our live workers that the coordinator shows healthy (admitted)."""
        world = self.view.world
        if world is None:
            return
        for rank, pid in self.view.running.items():
            if world.states.get(rank) == SlotState.HEALTHY and world.pids.get(rank) == pid:
                self.admitted[rank] = pid

    @property
    def relaunched(self) -> set[int]:
        return {a.rank for a in self.actions if a.kind == ActionKind.RELAUNCH}

    def relaunch(self, rank: int, why: str) -> None:
        """Relaunch ``rank`` in recover mode, within its budget of ``max_restarts`` per
        ``restart_window_s``; over it, the rank waits until the budget allows."""
        epoch, now, p = self.view.world.epoch, self.view.now, self.policy
        times = self.restarts.get(rank, ())
        if len(times) >= p.max_restarts:
            if rank not in self.waiting:
                wait_s = min(times) + p.restart_window_s - now
                logger.error("epoch %d: rank %d %s, and it was relaunched %d times in the "
                             "last %g s (--max-restarts %d --restart-window %g); relaunching "
                             "it in %.0f s", epoch, rank, why, len(times),
                             p.restart_window_s, p.max_restarts, p.restart_window_s, wait_s)
                self.waiting.append(rank)
            return
        if rank in self.waiting:
            self.waiting.remove(rank)
        self.restarts[rank] = (*times, now)
        logger.warning("epoch %d: rank %d %s; relaunching (restart %d in the last %g s)",
                       epoch, rank, why, len(times) + 1, p.restart_window_s)
        self.actions.append(Action(ActionKind.RELAUNCH, rank, why))

    def retry_waiting(self) -> None:
        """Relaunch the ranks over their budget once it allows (and still failed)."""
        world = self.view.world
        for rank in list(self.waiting):
            if world.states.get(rank) != SlotState.FAILED or rank in self.view.running:
                self.waiting.remove(rank)  # taken back by someone else, or scaled away
            elif len(self.restarts.get(rank, ())) < self.policy.max_restarts:
                self.relaunch(rank, "waited for its restart budget")

    def on_exit(self, ex: RankExit) -> None:
        world = self.view.world
        epoch = -1 if world is None else world.epoch  # only for the log lines
        if ex.code == ExitCode.REMOVED:
            logger.info("epoch %d: rank %d (pid %d) left after a planned removal", epoch,
                        ex.rank, ex.pid)
            return
        was_member = self.admitted.pop(ex.rank, None) == ex.pid
        if world is not None and world.states.get(ex.rank) == SlotState.FREE:
            # nothing to recover: its slot is free capacity (never admitted, or removed)
            logger.info("epoch %d: rank %d (pid %d) exited with %d %s; its slot is free "
                        "capacity again", epoch, ex.rank, ex.pid, ex.code,
                        "after it left the deployment" if was_member
                        else "before it was admitted")
            return
        if world is None:  # no hint: a relaunch needs the coordinator
            logger.warning("rank %d (pid %d) exited with %d while the coordinator is "
                           "unreachable", ex.rank, ex.pid, ex.code)
            return
        if not self.policy.relaunches(ex.code):
            logger.warning("epoch %d: rank %d (pid %d) exited with %d; relaunch it with `%s`",
                           epoch, ex.rank, ex.pid, ex.code,
                           recover_command(self.view.address, ex.rank, self.view.node))
            return
        if self.policy.on_exit != OnExit.RELAUNCH:
            self.relaunch(ex.rank, f"(pid {ex.pid}) was failed by the membership while it "
                          f"lived (exit {ex.code}: evicted, say after its node was cut off, "
                          "or it lost the coordinator); it rejoins its slot")
            return
        self.relaunch(ex.rank, f"(pid {ex.pid}) exited with {ex.code}")

    def kill_frozen(self) -> None:
        """Kill our workers the coordinator evicted but that are still alive (frozen)."""
        world = self.view.world
        if world is None:
            return
        relaunched = self.relaunched  # their live worker is the new one
        for rank, pid in self.view.running.items():
            if (rank not in relaunched and world.states.get(rank) == SlotState.FAILED
                    and world.pids.get(rank) == pid):
                logger.warning("epoch %d: rank %d (pid %d) was evicted but is alive; "
                               "killing it", world.epoch, rank, pid)
                self.actions.append(Action(ActionKind.KILL, rank))

    def adopt_failed(self) -> None:
        """Relaunch the failed ranks of this node that another launcher started (a `join`
        recovered them): a rank of the node is restarted whoever launched it. Our own
        ranks are left to their exit (the coordinator's pid for the slot is ours)."""
        world, view = self.view.world, self.view
        relaunched = self.relaunched
        for rank, state in world.states.items():
            pid = world.pids.get(rank)
            # a live worker of ours holds the slot: one relaunched in this very look
            # (``states`` predates it) or a frozen one (kill_frozen's)
            if (state != SlotState.FAILED or world.nodes.get(rank) != view.node
                    or pid is None or view.ours.get(rank) == pid or rank in view.running
                    or rank in relaunched or rank in self.waiting):
                continue
            self.relaunch(rank, f"(pid {pid}, started by another launcher on this node) "
                          "failed")
