"""Scale and retire operations an orchestrator polls by id (pure: no sockets, no torch).

Every ``POST /scale_elastic_ep`` (a new size, chosen ranks to retire, or a node to drain)
is one *operation*: the coordinator records it under an id (the caller's
``operation_id``, or one it makes up) with the slots it moves. ``GET
/scale_elastic_ep/{id}`` reads it back: its phase and, per slot, one of the states an
orchestrator acts on (:class:`RankOpState`). Asking again with the same id and the same
request changes nothing and answers the same operation, so a client that retries after
a lost answer cannot retire twice; the same id with another request is refused.

An operation's phase and rank states are derived from the slot states each time it is
read; the log itself (requests, slots, answers, which grows timed out or were
superseded) is part of the coordinator's durable state (``durable_state.py``), so a
coordinator that takes over answers the same ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elasticep.config import StrEnum

from .errors import OperationConflictError, OperationNotFoundError
from .transitions import SlotState


class RankOpState(StrEnum):
    """What an orchestrator may do with one slot an operation moves."""

    JOINING = "joining"    # a grow waits for this slot's joiner, or admits it
    ACTIVE = "active"      # a member serving requests and holding experts
    DRAINING = "draining"  # its experts and requests are moving to the others
    RETIRED = "retired"    # out of the group, holds nothing; its process is still exiting
    # out of the group and no process left, or (keep_processes) only an idle one that
    # holds no request and no expert: stopping it or its pod loses nothing
    SAFE_TO_TERMINATE = "safe_to_terminate"


class OpPhase(StrEnum):
    """Where an operation stands."""

    WAITING_FOR_JOINERS = "waiting_for_joiners"  # a grow's slot has no ready joiner yet
    ADMITTING = "admitting"   # every joiner is ready, some are not members yet
    DRAINING = "draining"     # a leaving slot is still a member
    RETIRING = "retiring"     # every leaving slot is out; some process still exits
    DONE = "done"             # every slot reached its end state
    TIMED_OUT = "timed_out"   # a grow gave up waiting for its joiners (its slots freed)
    SUPERSEDED = "superseded"  # a later operation replaced a grow that still waited


@dataclass(frozen=True)
class Operation:
    """One recorded scale or retire request.

    Attributes:
        id: the operation id.
        request: the request's fields as the caller gave them (``new_ep_size``,
            ``retire_ranks`` or ``drain_node``), compared on a repeat.
        slots: the slots it moves, sorted.
        leaving: True when the slots leave (retire, drain, shrink), False when they
            come in (grow).
        reply: the answer to the request that started it.
    """

    id: str
    request: dict[str, Any]
    slots: tuple[int, ...]
    leaving: bool
    reply: dict[str, Any] = field(default_factory=dict)

    @property
    def keeps_processes(self) -> bool:
        """The retired slots' workers stay up, idle (``keep_processes``)."""
        return bool(self.request.get("keep_processes"))


def rank_op_state(state: SlotState, leaving: bool, process_alive: bool,
                  keep_process: bool = False) -> RankOpState:
    """The operation state of one slot it moves (pure).

    Args:
        state: the slot's state.
        leaving: the operation takes the slot out (else it brings it in).
        process_alive: a worker process of the slot still runs.
        keep_process: the slot's worker stays up once out (``keep_processes``): a live
            one is not exiting, it idles, and may be stopped at once.
    """
    if state == SlotState.HEALTHY:
        return RankOpState.ACTIVE
    if state == SlotState.DRAINING:
        return RankOpState.DRAINING
    if not leaving:
        return RankOpState.JOINING
    if process_alive and not keep_process:
        return RankOpState.RETIRED
    return RankOpState.SAFE_TO_TERMINATE


def op_phase(op: Operation, ranks: Mapping[int, RankOpState], timed_out: bool = False,
             superseded: bool = False) -> OpPhase:
    """An operation's phase from its slots' states (pure).

    Args:
        op: the operation.
        ranks: slot -> its :func:`rank_op_state`.
        timed_out: a grow that gave up (see ``--elastic-ep-scale-timeout``).
        superseded: a grow replaced by a later operation before all its joiners were in.
    """
    if timed_out:
        return OpPhase.TIMED_OUT
    if superseded:
        return OpPhase.SUPERSEDED
    states = [ranks[s] for s in op.slots]
    if op.leaving:
        if any(st in (RankOpState.ACTIVE, RankOpState.DRAINING) for st in states):
            return OpPhase.DRAINING
        if any(st == RankOpState.RETIRED for st in states):
            return OpPhase.RETIRING
        return OpPhase.DONE
    if any(st == RankOpState.JOINING for st in states):
        return OpPhase.WAITING_FOR_JOINERS
    return OpPhase.DONE


def op_view(op: Operation, states: Sequence[SlotState], alive: Mapping[int, bool],
            timed_out: bool = False, superseded: bool = False) -> dict[str, Any]:
    """The ``GET /scale_elastic_ep/{id}`` body (pure).

    Args:
        op: the operation.
        states: slot state per slot, now.
        alive: slot -> a worker process of it still runs.
        timed_out, superseded: see :func:`op_phase`.

    Returns:
        ``{"operation_id", "request", "phase", "ranks": [{"rank", "state"}]}``; with
        ``keep_processes`` each rank also says ``process_running`` (its idle worker is
        still up, for the orchestrator to stop).
    """
    keep = op.keeps_processes
    ranks = {s: rank_op_state(states[s], op.leaving, alive.get(s, False), keep)
             for s in op.slots}
    entries: list[dict[str, Any]] = [{"rank": s, "state": ranks[s].value} for s in op.slots]
    if keep:
        for e in entries:
            e["process_running"] = alive.get(e["rank"], False)
    return {"operation_id": op.id, "request": dict(op.request),
            "phase": op_phase(op, ranks, timed_out, superseded).value, "ranks": entries}


@dataclass
class OperationLog:
    """Every operation of this coordinator, by id (kept for its lifetime: a handful a
    day)."""

    ops: dict[str, Operation] = field(default_factory=dict)
    timed_out: set[str] = field(default_factory=set)  # grows that gave up
    superseded: set[str] = field(default_factory=set)  # grows a later operation replaced
    next_id: int = 1  # of the next id made up (``op-N``)

    def repeat(self, op_id: str | None, request: Mapping[str, Any]) -> Operation | None:
        """The operation a repeated request names, or None for a new request.

        Raises:
            OperationConflictError: ``op_id`` names an operation of another request.
        """
        if op_id is None or op_id not in self.ops:
            return None
        op = self.ops[op_id]
        if op.request != dict(request):
            raise OperationConflictError(f"operation {op_id!r} was {op.request}, not "
                                         f"{dict(request)}; use a new operation_id")
        return op

    def new_id(self) -> str:
        """An id no operation has yet."""
        while True:
            op_id = f"op-{self.next_id}"
            self.next_id += 1
            if op_id not in self.ops:
                return op_id

    def superseding(self, states: Sequence[SlotState]) -> list[str]:
        """The grows a new operation would supersede, given ``states`` (the slot states
        before it): those that still wait for a joiner (a slot not healthy), neither
        timed out nor superseded already. The new operation sets a new target, so they
        never finish as asked."""
        return sorted(old.id for old in self.ops.values()
                      if not old.leaving and old.id not in self.timed_out
                      and old.id not in self.superseded
                      and any(s < len(states) and states[s] != SlotState.HEALTHY
                              for s in old.slots))

    def add(self, op: Operation, states: Sequence[SlotState] = ()) -> Operation:
        """Record ``op`` (its id must be new); the grows it supersedes
        (:meth:`superseding` of ``states``) read ``superseded`` from now on."""
        self.superseded.update(self.superseding(states))
        self.ops[op.id] = op
        return op

    def get(self, op_id: str) -> Operation:
        """Raises:
            OperationNotFoundError: no operation has this id.
        """
        try:
            return self.ops[op_id]
        except KeyError:
            raise OperationNotFoundError(f"no operation {op_id!r}") from None
