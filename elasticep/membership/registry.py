"""Coordinator-side records of a group and of its transition in progress (plain data).

These hold no sockets: the coordinator mutates them under its lock and
`membership.decide` turns a finished transition into a decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import JoinRefusedError
from .operations import OperationLog
from .scaling import Launch, ScaleTarget
from .transitions import (
    ACTIVE_STATES,
    OnFailure,
    Report,
    SlotState,
    TransitionKind,
    next_slot_state,
)


@dataclass
class Transition:
    """One epoch change in flight for a group.

    old_active: slots active in the committed epoch (they report); new_active: slots
    active once committed; dead/admitted/removed: why it changes.
    """

    epoch: int
    kind: TransitionKind
    old_active: set[int]
    new_active: set[int]
    dead: set[int] = field(default_factory=set)
    admitted: set[int] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)
    waiting: set[int] = field(default_factory=set)
    reports: dict[int, Report] = field(default_factory=dict)

    @staticmethod
    def begin(g: Group) -> Transition | None:
        """Start the next transition from the group's pending work, or None if idle.

        Deaths go first; admissions/removals wait for a later, death-free transition.
        """
        dead = g.pending_dead & g.active
        g.pending_dead -= g.pending_dead - g.active  # deaths of non-members need no epoch
        if dead:
            g.max_epoch += 1
            return Transition(g.max_epoch, TransitionKind.FAILURE, set(g.active),
                              g.active - dead, dead=dead)
        admit = {s for s in g.pending_admit if g.states[s] == SlotState.READY}
        remove = g.pending_remove & g.active
        g.pending_admit -= admit
        g.pending_remove -= remove
        if not admit and not remove:
            return None
        g.max_epoch += 1
        return Transition(g.max_epoch, TransitionKind.CHANGE, set(g.active), (g.active | admit) - remove,
                          admitted=admit, removed=remove)

    def restart(self, g: Group) -> Transition:
        """Fold deaths that happened mid-transition into a new announcement (new epoch)."""
        newly = g.pending_dead - self.dead
        self.admitted -= newly
        g.pending_dead -= newly - self.old_active
        self.dead |= newly & self.old_active
        if self.dead and self.kind == TransitionKind.CHANGE:
            # Admission/removal waits until the failure is handled.
            g.pending_admit |= self.admitted
            g.pending_remove |= self.removed
            self.admitted, self.removed = set(), set()
            self.kind = TransitionKind.FAILURE
        self.new_active = ((self.old_active | self.admitted) - self.removed) - self.dead
        g.max_epoch += 1
        self.epoch = g.max_epoch
        self.reports = {}
        return self


@dataclass
class Group:
    """Membership of one elastic group.

    ranks: global rank of each slot (len == max group size); states: slot states
    (free capacity is ``FREE``; change them only through :meth:`set_state`);
    active: committed active slots of `epoch`.
    """

    name: str
    ranks: list[int]
    states: list[SlotState]
    on_failure: OnFailure
    epoch: int = 0
    max_epoch: int = 0
    active: set[int] = field(default_factory=set)
    transition: Transition | None = None
    pending_dead: set[int] = field(default_factory=set)
    pending_admit: set[int] = field(default_factory=set)
    pending_remove: set[int] = field(default_factory=set)
    requests: dict[str, list[int]] = field(default_factory=lambda: {"admit": [], "remove": []})
    # slot -> the state a joiner took it from (failed or removed), until it is admitted
    joined_from: dict[int, SlotState] = field(default_factory=dict)

    @staticmethod
    def create(name: str, ranks: list[int], active: list[int], on_failure: OnFailure,
               dead_global: set[int]) -> Group:
        states = [SlotState.FREE] * len(ranks)
        for s in active:
            states[s] = SlotState.FAILED if ranks[s] in dead_global else SlotState.HEALTHY
        g = Group(name, list(ranks), states, on_failure)
        g.active = {s for s, st in enumerate(states) if st == SlotState.HEALTHY}
        return g

    def slot_of(self, global_rank: int) -> int:
        """Slot of a global rank. Raises ValueError if it is not in the group."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rank {global_rank} is not in group {self.name!r}") from None

    def set_state(self, slot: int, new: SlotState) -> None:
        """Change one slot's state through the transition table.

        Raises:
            ValueError: the change is not allowed (``membership.next_slot_state``).
        """
        old = self.states[slot]
        self.states[slot] = next_slot_state(old, new)
        joining = (SlotState.JOINING, SlotState.READY)
        if self.states[slot] in joining:
            if old not in joining:
                self.joined_from[slot] = old
        else:
            self.joined_from.pop(slot, None)

    def request(self, kind: str, slots: list[int]) -> None:
        """Ask the members to ``kind`` ("admit" or "remove") ``slots`` at a step boundary.
        The newest intent for a slot wins over an older, unapplied one of the other kind."""
        other = "remove" if kind == "admit" else "admit"
        self.requests[kind] = sorted(set(self.requests[kind]) | set(slots))
        self.requests[other] = [r for r in self.requests[other] if r not in slots]

    def keep_processes(self, slots: list[int]) -> None:
        """The workers of ``slots`` stay up, idle, once a removal takes them out
        (``keep_processes``): the removed rank reads this with the removal request
        itself, so it is set before that request is pushed. Cleared when the slot is
        admitted again."""
        self.requests["keep"] = sorted(set(self.requests.get("keep", [])) | set(slots))

    def bind_reserved_slot(self, rank: int, joiner_ranks: list[int]) -> None:
        """Give a joiner the reserved slot (global rank -1) at which its own list names
        it; unchanged if there is none (`slot_of` then refuses it)."""
        if rank in joiner_ranks:
            slot = joiner_ranks.index(rank)
            if slot < len(self.ranks) and self.ranks[slot] == -1:
                self.ranks[slot] = rank

    def leaving(self, slot: int) -> bool:
        """``slot`` is being scaled away: draining, or its removal is requested or in
        flight."""
        tr = self.transition
        return (self.states[slot] == SlotState.DRAINING or slot in self.pending_remove
                or slot in self.requests["remove"] or (tr is not None and slot in tr.removed))

    def is_active_rank(self, global_rank: int) -> bool:
        return global_rank in self.ranks and self.states[self.slot_of(global_rank)] in ACTIVE_STATES

    def commit(self, tr: Transition) -> None:
        """Apply a finished transition to the committed membership."""
        self.epoch, self.active = tr.epoch, set(tr.new_active)
        for s in tr.admitted:
            self.set_state(s, SlotState.HEALTHY)
        for s in tr.removed:
            self.set_state(s, SlotState.FREE)
        self.pending_dead -= tr.dead
        # Members call deactivate_ranks/recover_ranks at different steps, so a late
        # caller can re-queue a change this transition already applies; left queued, it
        # would fire again when the slot is next re-admitted (or removed).
        self.pending_remove -= tr.removed
        self.pending_admit -= tr.admitted
        for key, done in (("admit", tr.admitted), ("remove", tr.removed),
                          ("keep", tr.admitted)):
            if key in self.requests:
                self.requests[key] = [r for r in self.requests[key] if r not in done]
        self.transition = None

    def status(self) -> dict:
        return {"epoch": self.epoch, "active": sorted(self.active), "states": list(self.states),
                "ranks": list(self.ranks), "on_failure": self.on_failure,
                "requests": self.requests,
                "transition": None if self.transition is None else self.transition.epoch}


@dataclass
class DeploymentRecords:
    """What the coordinator keeps about the deployment besides the groups.

    config: the deployment's settings as published by node 0 (JSON text; the
    coordinator does not read it); target: the target size and the scale in progress
    (None until published); launches: rank -> live launched worker, with the supervisor
    connection that recorded it (dropped with that connection); nodes: rank -> node of
    its last launch; reservations: rank -> (owner connection, who) of a `join` that is
    launching it.
    """

    config: str | None = None
    target: ScaleTarget | None = None
    launches: dict[int, tuple[int, Launch]] = field(default_factory=dict)
    nodes: dict[int, int] = field(default_factory=dict)
    reservations: dict[int, tuple[int, str]] = field(default_factory=dict)
    # scale and retire operations by id; the fewest healthy ranks holding every expert
    operations: OperationLog = field(default_factory=OperationLog)
    min_holding_ranks: int = 1
    scale_timeout_s: float = 600.0

    def live_launches(self) -> dict[int, Launch]:
        """rank -> live launched worker."""
        return {r: launch for r, (_owner, launch) in self.launches.items()}

    def record_launch(self, owner: int, rank: int, node: int, pid: int) -> None:
        """Supervisor connection ``owner`` started worker ``pid`` for ``rank`` on ``node``."""
        self.launches[rank] = (owner, Launch(node, pid))
        self.nodes[rank] = node

    def clear_launch(self, rank: int, pid: int) -> None:
        """Worker ``pid`` of ``rank`` exited (kept if a newer launch replaced it)."""
        if rank in self.launches and self.launches[rank][1].pid == pid:
            del self.launches[rank]

    def reserve(self, owner: int, who: str, ranks: list[int]) -> None:
        """Claim every slot of ``ranks`` for ``owner``, or none.

        Raises:
            JoinRefusedError: a slot is claimed by another owner.
        """
        for r in ranks:
            held = self.reservations.get(r)
            if held is not None and held[0] != owner:
                raise JoinRefusedError(f"rank {r} is already being joined ({held[1]})")
        for r in ranks:
            self.reservations[r] = (owner, who)

    def release(self, owner: int, ranks: list[int] | None = None) -> None:
        """Drop ``owner``'s claims (of ``ranks``, or all)."""
        for r, (o, _who) in list(self.reservations.items()):
            if o == owner and (ranks is None or r in ranks):
                del self.reservations[r]

    def drop_owner(self, owner: int) -> None:
        """A supervisor connection closed: its launches and claims go with it."""
        self.release(owner)
        for r, (o, _launch) in list(self.launches.items()):
            if o == owner:
                del self.launches[r]
