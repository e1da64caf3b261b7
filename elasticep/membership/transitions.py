"""Pure membership decisions: slot states and epoch transitions (no sockets, no torch).

A *transition* moves a group from epoch e to e' > e. The coordinator announces it, each
old member reports its op progress (`Report`), and `decide` turns the reports into one
`Decision` that every member applies identically.

Two kinds of transition:

* ``"change"`` (admission / planned removal, nobody died): the old inner group still
  works, so ops in flight finish on it. The boundary is ``B = max(started) + 1``; ops with
  seq < B run in the old epoch, ops >= B in the new one (the joiner starts at B).
* ``"failure"`` (some member died): ``r = min(last) + 1`` is the lowest op some survivor
  has not completed and ``M = max(last)`` the highest op some survivor completed
  (normally M <= r). Ops r..M are *fetched* from a donor's kept result when every one of
  them is fetchable (identical on all ranks: all_reduce, broadcast, all_gather, barrier).
  Op M+1 is the *pivot*: nobody completed it, so it is redone in the new epoch
  (on_failure="complete" and a redoable op) or raised. If some op in r..M is not
  fetchable (all_to_all_single, reduce_scatter, ...) every survivor raises at its current
  op. After a raise every survivor continues at seq ``M + 2`` (`Decision.base`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from elasticep.enums import StrEnum


class SlotState(str, Enum):
    """The state of one slot (rank id) of a group, as the coordinator records it.

    A ``str`` enum: it travels as its value in the JSON control messages and in
    ``/elastic_ep_status``, and compares equal to that value.
    """

    FAILED = "failed"      # its process died or was evicted; `join recover` relaunches it
    JOINING = "joining"    # a joiner registered (or, in the status, is still loading)
    READY = "ready"        # the joiner loaded its weights and waits to be admitted
    HEALTHY = "healthy"    # an active member
    DRAINING = "draining"  # an active member being scaled away
    FREE = "free"          # free capacity: never used, scaled away, or given back

    def __str__(self) -> str:
        return self.value


SLOT_STATES = tuple(SlotState)
ACTIVE_STATES = frozenset({SlotState.HEALTHY, SlotState.DRAINING})

_S = SlotState
# Allowed slot state changes (old -> new); anything else is a bug or a refused request.
# Every change the coordinator makes goes through `next_slot_state`, so a new state is one
# row here plus the places that choose it.
_ALLOWED: dict[SlotState, frozenset[SlotState]] = {
    _S.FAILED: frozenset({_S.JOINING, _S.READY, _S.FAILED, _S.FREE}),
    _S.FREE: frozenset({_S.JOINING, _S.READY, _S.FREE}),
    _S.JOINING: frozenset({_S.READY, _S.FAILED, _S.HEALTHY, _S.FREE}),
    _S.READY: frozenset({_S.HEALTHY, _S.FAILED, _S.FREE}),
    _S.HEALTHY: frozenset({_S.FAILED, _S.DRAINING, _S.FREE}),
    _S.DRAINING: frozenset({_S.FAILED, _S.FREE, _S.HEALTHY, _S.DRAINING}),
}


def state_after_death(state: SlotState, leaving: bool, in_membership: bool,
                      joined_from: SlotState | None) -> SlotState:
    """The state of a slot whose process died (pure).

    Args:
        state: the slot's state when it died.
        leaving: it was being scaled away (draining).
        in_membership: it is an active member, or being admitted by the transition in
            flight.
        joined_from: for a joiner, the state its slot had before it joined.

    Returns:
        ``free`` for a slot removed on purpose or leaving anyway; for a joiner that
        was not admitted yet, the state it took the slot from (free capacity stays free
        capacity: the deployment is not degraded and `join scale` may take it again);
        ``failed`` otherwise.
    """
    if leaving or state == SlotState.FREE:
        return SlotState.FREE
    if (state in (SlotState.JOINING, SlotState.READY) and not in_membership
            and joined_from is not None):
        return joined_from
    return SlotState.FAILED


def next_slot_state(state: str, new: str) -> SlotState:
    """Validate a slot state change and return the new state.

    Args:
        state: the slot's current state.
        new: the state asked for.

    Raises:
        ValueError: the change is not allowed (e.g. a joiner for a healthy slot), or a
            state is unknown.
    """
    old, to = SlotState(state), SlotState(new)
    if to not in _ALLOWED[old]:
        raise ValueError(f"slot cannot go from {old.value!r} to {to.value!r}")
    return to


class ScalePhase(str, Enum):
    """Where a requested change of the target size stands (``/elastic_ep_status``).

    Derived from the slot states and the slots a scale brings in or takes out
    (:func:`scale_phase`), never stored on its own.
    """

    IDLE = "idle"                                # no scale running
    WAITING_FOR_JOINERS = "waiting_for_joiners"  # a new slot has no ready joiner yet
    ADMITTING = "admitting"                      # every new slot is ready, some not admitted
    DRAINING = "draining"                        # a leaving slot is still active

    def __str__(self) -> str:
        return self.value


def scale_phase(states: Sequence[str], up: Iterable[int], down: Iterable[int]) -> ScalePhase:
    """The scale phase of a membership snapshot (pure).

    Args:
        states: slot state per slot.
        up: slots a scale-up is bringing in.
        down: slots a scale-down is taking out.
    """
    up, down = list(up), list(down)
    if any(states[s] not in (_S.READY, _S.HEALTHY) for s in up):
        return ScalePhase.WAITING_FOR_JOINERS
    if any(states[s] != _S.HEALTHY for s in up):
        return ScalePhase.ADMITTING
    if any(states[s] in ACTIVE_STATES for s in down):
        return ScalePhase.DRAINING
    return ScalePhase.IDLE


@dataclass(frozen=True)
class Report:
    """One old member's progress, frozen at the announcement.

    last: seq of its last completed op (-1 if none); started: seq of the op in flight,
    or ``last`` when idle; fetchable: seqs whose result it kept and can hand to others.
    """

    last: int
    started: int
    fetchable: frozenset[int] = frozenset()


class TransitionKind(StrEnum):
    """Why a group's epoch changes."""

    FAILURE = "failure"  # some member died
    CHANGE = "change"    # admission / planned removal, nobody died


class OpAction(StrEnum):
    """What a survivor does with one op under an unapplied failure decision
    (:func:`local_action`)."""

    FETCH = "fetch"  # take the donor's kept result
    RUN = "run"      # execute it on the new epoch
    RAISE = "raise"  # raise RankFailureError and continue at `Decision.base`
    DONE = "done"    # the decision no longer concerns this op


class OnFailure(StrEnum):
    """A group's failure mode (``BackendOptions(on_failure=...)``)."""

    COMPLETE = "complete"  # finish reductions/barrier/broadcast over the survivors
    RAISE = "raise"        # RankFailureError unless a survivor already completed the op


@dataclass(frozen=True)
class Decision:
    """The outcome of one transition; sent to members as a dict (`to_dict`)."""

    kind: TransitionKind
    epoch: int
    active: tuple[int, ...]  # group slots active in `epoch`, sorted
    dead: tuple[int, ...] = ()
    resume: int = 0  # failure: lowest op some survivor has not completed
    last: int = -1  # failure: highest op some survivor completed (M)
    donors: dict[int, int] = field(default_factory=dict)  # seq -> slot holding its result
    fetchable: bool = True  # failure: every op resume..last can be fetched
    boundary: int = 0  # first seq that runs on this epoch's inner group

    @property
    def base(self) -> int:
        """Seq every survivor continues at after raising (failure transitions)."""
        return self.last + 2

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "epoch": self.epoch, "active": list(self.active),
            "dead": list(self.dead), "resume": self.resume, "last": self.last,
            "donors": {str(k): v for k, v in self.donors.items()},
            "fetchable": self.fetchable, "boundary": self.boundary,
        }

    @staticmethod
    def from_dict(d: dict) -> Decision:
        return Decision(
            kind=TransitionKind(d["kind"]), epoch=d["epoch"], active=tuple(d["active"]), dead=tuple(d["dead"]),
            resume=d["resume"], last=d["last"],
            donors={int(k): v for k, v in d["donors"].items()},
            fetchable=d["fetchable"], boundary=d["boundary"],
        )


def decide(
    kind: TransitionKind, epoch: int, active: set[int], dead: set[int], reports: dict[int, Report]
) -> Decision:
    """Turn the survivors' reports into the transition's decision.

    Args:
        kind: FAILURE if any old member died, else CHANGE.
        epoch: the new epoch.
        active: slots active in the new epoch.
        dead: slots that died (failure only).
        reports: slot -> Report for every old member that is still alive (may be empty
            when no old member survives; then the joiners start at seq 0).

    Raises:
        ValueError: unknown kind.
    """
    act = tuple(sorted(active))
    if not reports:
        return Decision(kind=TransitionKind(kind), epoch=epoch, active=act,
                        dead=tuple(sorted(dead)))
    if kind == TransitionKind.CHANGE:
        boundary = max(r.started for r in reports.values()) + 1
        return Decision(kind=TransitionKind.CHANGE, epoch=epoch, active=act, boundary=boundary,
                        last=boundary - 1, resume=boundary)
    if kind != TransitionKind.FAILURE:
        raise ValueError(f"unknown transition kind {kind!r}")
    resume = min(r.last for r in reports.values()) + 1
    last = max(r.last for r in reports.values())
    donors: dict[int, int] = {}
    fetchable = True
    for seq in range(resume, last + 1):
        holders = sorted(s for s, r in reports.items() if r.last >= seq and seq in r.fetchable)
        if not holders:
            fetchable = False
            donors.clear()
            break
        donors[seq] = holders[0]
    return Decision(kind=TransitionKind.FAILURE, epoch=epoch, active=act, dead=tuple(sorted(dead)),
                    resume=resume, last=last, donors=donors, fetchable=fetchable,
                    boundary=last + 1)


def local_action(decision: Decision, seq: int, op_fetchable: bool, op_redoable: bool,
                 on_failure: OnFailure) -> OpAction:
    """What a survivor does with its op `seq` under an unapplied failure decision.

    Returns one of FETCH (take the donor's kept result), RUN (execute on the new
    epoch), RAISE (raise RankFailureError and continue at `decision.base`), or DONE
    (the decision no longer concerns ops >= seq).
    """
    if seq > decision.last + 1:
        return OpAction.DONE
    if not decision.fetchable:
        return OpAction.RAISE
    if seq <= decision.last:
        return OpAction.FETCH if op_fetchable else OpAction.RAISE
    # seq == last + 1: the pivot, completed by nobody.
    if on_failure == OnFailure.COMPLETE and op_redoable:
        return OpAction.RUN
    return OpAction.RAISE
