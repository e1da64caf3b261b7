"""Deployment-level membership on top of the WORLD group (pure: no sockets, no torch).

The coordinator owns, besides the slot states of every group:

* the *target* size ``ep_size`` and the slots a scale brings in (``up``) or takes out
  (``down``); the scale phase is derived from those and the slot states;
* the *launch records*: which node each rank runs on, and the pid of a worker started
  for it that has not exited (a worker loads its weights before it registers, so this
  is how a loading worker shows up as ``joining``);
* the *reservations* of slots that a `join` is launching, so two joins cannot both
  start a worker for one slot.

This module holds the decisions over that data: :class:`ScaleTarget` plans a scale,
:func:`deployment_status` builds the ``/elastic_ep_status`` view and :func:`check_join`
decides whether a slot may be joined. The coordinator only applies them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import JoinRefusedError, ScaleInProgressError, ScaleRefusedError
from .status import DeploymentStatus, RankStatus
from .transitions import ACTIVE_STATES, ScalePhase, SlotState, scale_phase

logger = logging.getLogger(__name__)

# the slot state a joiner of each mode takes
JOIN_TAKES = {"recover": SlotState.FAILED, "scale": SlotState.FREE}


@dataclass(frozen=True)
class Launch:
    """A worker some launcher started and that has not exited: its node and pid."""

    node: int
    pid: int


@dataclass(frozen=True)
class ProcInfo:
    """What the coordinator knows of a registered process: its pid, whether it is alive,
    and whether it has registered its WORLD slot yet."""

    pid: int
    alive: bool
    in_world: bool


@dataclass(frozen=True)
class ScalePlan:
    """The requests one scale makes: slots to admit and slots to deactivate."""

    admit: tuple[int, ...] = ()
    remove: tuple[int, ...] = ()
    reply: dict = field(default_factory=dict)  # the HTTP answer's body
    free: tuple[int, ...] = ()  # failed slots now above the target: free capacity again


@dataclass
class ScaleTarget:
    """The operator's target membership and the scale in progress.

    Args:
        ep_size: the target number of active ranks.
        max_ep_size: capacity.
        members: the slots the target keeps (None: ``[0, ep_size)``); a retirement takes
            chosen slots out, so they need not be the lowest. ``ep_size`` is always
            ``len(members)``.
    """

    ep_size: int
    max_ep_size: int
    up: set[int] = field(default_factory=set)
    down: set[int] = field(default_factory=set)
    members: set[int] | None = None
    # slots a retirement took out: `join` in recover mode may bring them back
    retired: set[int] = field(default_factory=set)
    # clock time after which a grow still waiting for joiners gives up (None: no grow)
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.members is None:
            self.members = set(range(self.ep_size))
        self.ep_size = len(self.members)

    def _set_members(self, members: set[int]) -> None:
        self.members = set(members)
        self.ep_size = len(self.members)

    def phase(self, states: Sequence[SlotState]) -> ScalePhase:
        """The scale phase now; a finished scale is forgotten (and logged) here."""
        phase = scale_phase(states, self.up, self.down)
        if phase == ScalePhase.IDLE and (self.up or self.down):
            logger.info("scale to ep_size %d finished", self.ep_size)
            self.up, self.down = set(), set()
        return phase

    def plan(self, new_ep_size: int, states: Sequence[SlotState]) -> ScalePlan:
        """Grow to ``new_ep_size`` (admit joiners of the lowest slots outside the target)
        or shrink (drain and remove the highest slots of the target), and make it the
        target. With no slot retired out of order these are the slots
        ``[ep_size, new)`` and ``[new, max_ep_size)``.

        While a grow still waits for joiners, a smaller target that is not below the
        size before the grow withdraws the slots above it that are not admitted yet (a
        joiner that died need not be replaced to finish the scale).

        Raises:
            ValueError: ``new_ep_size`` outside ``[1, max_ep_size]``.
            ScaleInProgressError: a scale is still running (and this is not such a
                withdrawal).
            ScaleRefusedError: a shrink that keeps no healthy rank (the ones it keeps
                have failed or are still joining): it would empty the deployment.
        """
        if not 1 <= new_ep_size <= self.max_ep_size:
            raise ValueError(f"new_ep_size must be in [1, {self.max_ep_size}], "
                             f"got {new_ep_size}")
        phase = self.phase(states)
        old = self.ep_size
        members = sorted(self.members)
        if (phase == ScalePhase.WAITING_FOR_JOINERS
                and old - len(self.up) <= new_ep_size < old):
            slots = sorted(self.up)[len(self.up) - (old - new_ep_size):]
            admitted = [s for s in slots if states[s] == SlotState.HEALTHY]
            if admitted:
                raise ScaleInProgressError(
                    f"ranks {admitted} are already admitted; wait for the scale to ep_size "
                    f"{old}, then scale down")
            self.up -= set(slots)
            self._set_members(self.members - set(slots))
            logger.info("pending scale to ep_size %d lowered to %d, slots %s withdrawn", old,
                        new_ep_size, slots)
            return ScalePlan(remove=tuple(slots), reply=self._reply(old, slots, states))
        if phase != ScalePhase.IDLE:
            raise ScaleInProgressError(f"a scale to ep_size {old} is in progress ({phase})")
        admit: list[int] = []
        remove: list[int] = []
        kept = members[:new_ep_size]
        if new_ep_size > old:
            outside = [s for s in range(self.max_ep_size) if s not in self.members]
            admit = outside[:new_ep_size - old]
            self.up = set(admit)
            kept = members + admit
        elif new_ep_size < old:
            refuse_empty_shrink(new_ep_size, states, kept)
            remove = [s for s in members[new_ep_size:] if states[s] in ACTIVE_STATES]
            self.down = set(remove)
        # a failed slot the new target leaves out is not a failure any more: it is free
        # capacity (a later grow takes it with `join scale`, not `recover`)
        free = tuple(s for s in range(self.max_ep_size)
                     if s not in kept and states[s] == SlotState.FAILED)
        self._set_members(set(kept))
        self.retired -= set(admit)
        logger.info("scale ep_size %d -> %d, slots %s", old, new_ep_size, admit or remove)
        return ScalePlan(tuple(admit), tuple(remove), self._reply(old, admit or remove, states),
                         free)

    def retire(self, ranks: Sequence[int], states: Sequence[SlotState],
               min_holding_ranks: int = 1) -> ScalePlan:
        """Take the chosen slots ``ranks`` out of the target: the active ones drain (their
        experts and requests move to the others) and are removed, failed ones become
        free capacity at once. They may come back with ``join`` in recover mode or a
        grow.

        Args:
            ranks: slots of the target to retire (any order, no duplicates).
            states: slot state per slot.
            min_holding_ranks: the fewest healthy ranks whose expert slots hold every
                expert without growing (``ceil(E / slots_per_rank)``; 1: no limit known).

        Raises:
            ValueError: a slot is outside the capacity, listed twice, or not in the target
                (free capacity or retired already).
            ScaleInProgressError: a scale is still running, or a slot is being joined.
            ScaleRefusedError: no healthy rank would be left, or fewer than
                ``min_holding_ranks`` (they could not hold every expert).
        """
        retire = sorted(set(ranks))
        if not retire or len(retire) != len(ranks):
            raise ValueError(f"retire_ranks must be distinct slots, got {list(ranks)}")
        for r in retire:
            if not 0 <= r < self.max_ep_size:
                raise ValueError(f"rank {r} is outside the capacity [0, {self.max_ep_size})")
            if r not in self.members:
                raise ValueError(f"rank {r} is {states[r].value}, not in the deployment's "
                                 f"target (ranks {sorted(self.members)})")
            if states[r] in (SlotState.JOINING, SlotState.READY):
                raise ScaleInProgressError(f"rank {r} is {states[r].value} (being taken "
                                           "back); retire it once it is healthy or failed")
        phase = self.phase(states)
        if phase != ScalePhase.IDLE:
            raise ScaleInProgressError(f"a scale to ep_size {self.ep_size} is in progress "
                                       f"({phase})")
        kept = [s for s in sorted(self.members) if s not in retire]
        healthy = [s for s in kept if states[s] == SlotState.HEALTHY]
        if not healthy:
            shown = ", ".join(f"rank {s} is {states[s].value}" for s in kept) or "none kept"
            raise ScaleRefusedError(f"retiring ranks {retire} would leave no healthy rank "
                                    f"({shown})")
        if len(healthy) < min_holding_ranks:
            raise ScaleRefusedError(
                f"retiring ranks {retire} would leave {len(healthy)} healthy ranks "
                f"({healthy}), but every expert needs at least {min_holding_ranks} ranks' "
                f"expert slots (serve --min-ep-size)")
        old = self.ep_size
        remove = [s for s in retire if states[s] in ACTIVE_STATES]
        free = tuple(s for s in retire if states[s] == SlotState.FAILED)
        self.down = set(remove)
        self.retired |= set(retire)
        self._set_members(set(kept))
        logger.info("retire ranks %s: ep_size %d -> %d", retire, old, self.ep_size)
        return ScalePlan((), tuple(remove), self._reply(old, retire, states), free)

    def waiting_slots(self, states: Sequence[SlotState]) -> list[int]:
        """The slots a grow brings in whose joiner is not ready yet (pure)."""
        return sorted(s for s in self.up if states[s] not in (SlotState.READY,
                                                              SlotState.HEALTHY))

    def give_up(self, now: float, states: Sequence[SlotState]) -> ScalePlan | None:
        """Past its deadline, a grow that still waits for joiners gives up: the slots
        not admitted yet are withdrawn (their admission too) and the target shrinks by
        them; admitted ones stay.

        Returns:
            The withdrawal, or None if no grow waits past its deadline.
        """
        if self.deadline is None or now < self.deadline:
            return None
        if self.phase(states) != ScalePhase.WAITING_FOR_JOINERS:
            self.deadline = None  # every joiner is in (or being admitted): no timeout
            return None
        old = self.ep_size
        slots = sorted(s for s in self.up if states[s] != SlotState.HEALTHY)
        self.up -= set(slots)
        self._set_members(self.members - set(slots))
        self.deadline = None
        logger.warning("scale to ep_size %d timed out waiting for joiners of slots %s; "
                       "ep_size is %d", old, slots, self.ep_size)
        return ScalePlan(remove=tuple(slots), reply=self._reply(old, slots, states))

    def readmit(self, rank: int) -> None:
        """A retired slot comes back through ``join`` in recover mode: it is in the
        target again."""
        self.retired.discard(rank)
        self._set_members(self.members | {rank})

    def _reply(self, old: int, slots: list[int], states: Sequence[SlotState]) -> dict:
        return {"old_ep_size": old, "slots": list(slots),
                "scale_phase": scale_phase(states, self.up, self.down).value}


def refuse_empty_shrink(new_ep_size: int, states: Sequence[SlotState],
                        kept: Sequence[int] | None = None) -> None:
    """Refuse a shrink to ``new_ep_size`` slots none of which is healthy (pure): every
    rank that could serve, and hold the experts of the drained ones, would be removed.

    Args:
        new_ep_size: the target size asked for.
        states: slot state per slot.
        kept: the slots the shrink keeps (None: ``[0, new_ep_size)``).

    Raises:
        ScaleRefusedError: one line naming the kept slots' states and the healthy ranks
            the shrink would remove.
    """
    kept = list(range(new_ep_size)) if kept is None else list(kept)
    if any(states[s] == SlotState.HEALTHY for s in kept):
        return
    healthy = [s for s, st in enumerate(states) if st == SlotState.HEALTHY]
    shown = ", ".join(f"rank {s} is {states[s].value}" for s in kept)
    raise ScaleRefusedError(f"new_ep_size {new_ep_size} would leave no healthy rank ({shown}; "
                            f"it would remove the healthy ranks {healthy})")


def shown_slots(states: Sequence[SlotState], ranks: Sequence[int],
                procs: Mapping[int, ProcInfo], launches: Mapping[int, Launch],
                ) -> list[tuple[SlotState, int | None]]:
    """(state, pid) of each slot as the status shows it (pure).

    A slot that is ``failed``, ``free`` or not registered yet, for which a launcher
    started a worker that has not registered (the launch's pid differs from the
    registered one) or has registered its process but not its WORLD slot yet (same pid,
    alive, in no group), is shown ``joining`` with the new pid: workers load their
    weights before they register. A member being scaled away is also alive in a free
    slot, but it is in the group: it stays free. Once that process has exited, a free
    slot shows no pid: it holds no rank, and its old pid may be another process's by
    now (a ``failed`` slot keeps the dead pid: it names the rank that failed), and is
    shown free even before its launcher has recorded the exit.
    """
    shown = []
    for slot, state in enumerate(states):
        proc = procs.get(ranks[slot])
        pid = None if proc is None else proc.pid
        if state == SlotState.FREE and proc is not None and not proc.alive:
            pid = None
        launch = launches.get(ranks[slot])
        if launch is not None and (state in (SlotState.FAILED, SlotState.FREE)
                                   or proc is None):
            registered_joiner = (proc is not None and launch.pid == pid and proc.alive
                                 and not proc.in_world)
            # the launch is the process that just left (its launcher has not recorded
            # the exit yet): nothing joins
            left = proc is not None and not proc.alive and launch.pid == proc.pid
            if not left and (launch.pid != pid or registered_joiner):
                state, pid = SlotState.JOINING, launch.pid
        shown.append((state, pid))
    return shown


def deployment_status(epoch: int, states: Sequence[SlotState] | None, ranks: Sequence[int],
                      target: ScaleTarget, procs: Mapping[int, ProcInfo],
                      launches: Mapping[int, Launch], nodes: Mapping[int, int],
                      ) -> DeploymentStatus:
    """The ``/elastic_ep_status`` view (pure).

    Args:
        epoch: WORLD's committed epoch.
        states: WORLD's slot states; None before the first worker registered (then the
            first ``ep_size`` slots are ``joining``, they are loading, and the rest
            ``free``).
        ranks: global rank of each slot.
        target: the target size and the scale in progress.
        procs: rank -> registered process.
        launches: rank -> live launched worker.
        nodes: rank -> node of its last launch (shown as None if never recorded: a new
            leader learns it from the node's next launch, and a guess would point a node
            at another node's pid).
    """
    if states is None:
        states = ([SlotState.JOINING] * target.ep_size
                  + [SlotState.FREE] * (target.max_ep_size - target.ep_size))
    phase = target.phase(states)
    shown = shown_slots(states, ranks, procs, launches)
    return DeploymentStatus(epoch, target.ep_size, target.max_ep_size, phase, tuple(
        RankStatus(ranks[s], st, pid, nodes.get(ranks[s]))
        for s, (st, pid) in enumerate(shown)), tuple(target.waiting_slots(states)))


def check_join(mode: str, want: Sequence[int], states: Sequence[SlotState],
               ranks: Sequence[int], target: ScaleTarget, procs: Mapping[int, ProcInfo],
               launches: Mapping[int, Launch]) -> None:
    """Refuse slots outside the capacity (recover: outside the target ``ep_size``), not
    free for ``mode``, or already being joined (pure).

    Raises:
        JoinRefusedError: with the slot, its state and pid.
    """
    shown = shown_slots(states, ranks, procs, launches)
    for r in want:
        if not 0 <= r < target.max_ep_size:
            raise JoinRefusedError(f"rank {r} is outside the capacity [0, "
                                   f"{target.max_ep_size}) (serve --max-ep-size)")
        slot = list(ranks).index(r)
        state = states[slot]
        proc = procs.get(r)
        pid = None if proc is None else proc.pid
        if state in (SlotState.JOINING, SlotState.READY) or shown[slot][0] == SlotState.JOINING:
            pid = pid if state in (SlotState.JOINING, SlotState.READY) else shown[slot][1]
            raise JoinRefusedError(f"rank {r} is already being joined (pid {pid})")
        if state == SlotState.FREE and proc is not None and proc.alive and proc.in_world:
            raise JoinRefusedError(f"rank {r} left the deployment but its worker (pid {pid}) "
                                   "still runs (kept by keep_processes, or exiting); stop it "
                                   "first")
        if mode == "recover" and r in target.retired and state == SlotState.FREE:
            continue  # a retired slot comes back in place
        if mode == "recover" and r not in target.members:
            raise JoinRefusedError(f"rank {r} is outside ep_size {target.ep_size}; use "
                                   "--elastic-ep-join-mode scale")
        if state == JOIN_TAKES[mode]:
            continue
        if state == SlotState.FREE:
            raise JoinRefusedError(f"rank {r} is free capacity (or was removed by a "
                                   "scale-down); use --elastic-ep-join-mode scale and POST "
                                   "/scale_elastic_ep")
        if state == SlotState.FAILED:
            raise JoinRefusedError(f"rank {r} has failed; relaunch it with "
                                   "--elastic-ep-join-mode recover")
        raise JoinRefusedError(f"rank {r} is {state.value} (pid {pid}); join only takes "
                               f"{JOIN_TAKES[mode].value} slots in {mode} mode")
