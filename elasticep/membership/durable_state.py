"""The coordinator's durable state as plain JSON: what a new leader must reload to go on.

It is the part of :class:`~elasticep.membership.service.MembershipService` that outlives
a coordinator process: every group's epoch, active set, slot states, pending work and
transition in flight, the deployment's published config, its scale target (size, the
slots it keeps and has retired, and the slots a scale brings in or takes out), the
limits a scale is checked against, and the scale and retire operations by id.
Connections, processes, launches and heartbeat clocks are not in it: they are rebuilt
by the ranks and launchers reconnecting. Nor is a waiting grow's deadline (a reading of
the old leader's monotonic clock): the new leader gives it a full timeout again.

A transition in flight is kept without its reports: the reports were answers to an
announcement of the old leader, so the new leader restarts the transition at a fresh
epoch (``Transition.restart``) and collects them again.

Pure: no sockets, no store. ``to_json``/``from_json`` are inverse, and
``MembershipState.from_json(s.to_json()) == s``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .operations import Operation, OperationLog
from .registry import DeploymentRecords, Group, Transition
from .scaling import ScaleTarget
from .transitions import OnFailure, SlotState, TransitionKind

FORMAT = 1  # bump when a field changes meaning; an unknown format is refused


def _slots(xs: set[int]) -> list[int]:
    return sorted(xs)


def transition_record(tr: Transition) -> dict:
    """The durable fields of ``tr`` (no ``waiting`` or ``reports``)."""
    return {"epoch": tr.epoch, "kind": tr.kind.value, "old_active": _slots(tr.old_active),
            "new_active": _slots(tr.new_active), "dead": _slots(tr.dead),
            "admitted": _slots(tr.admitted), "removed": _slots(tr.removed)}


def transition_from_record(d: dict) -> Transition:
    return Transition(d["epoch"], TransitionKind(d["kind"]), set(d["old_active"]),
                      set(d["new_active"]), dead=set(d["dead"]), admitted=set(d["admitted"]),
                      removed=set(d["removed"]))


def group_record(g: Group) -> dict:
    """Every field of ``g`` as JSON-able data (slot states by value)."""
    return {"name": g.name, "ranks": list(g.ranks), "states": [s.value for s in g.states],
            "on_failure": g.on_failure.value, "epoch": g.epoch, "max_epoch": g.max_epoch,
            "active": _slots(g.active),
            "transition": None if g.transition is None else transition_record(g.transition),
            "pending_dead": _slots(g.pending_dead), "pending_admit": _slots(g.pending_admit),
            "pending_remove": _slots(g.pending_remove),
            "requests": {k: sorted(v) for k, v in g.requests.items()},
            "joined_from": {str(s): st.value for s, st in sorted(g.joined_from.items())}}


def group_from_record(d: dict) -> Group:
    """Inverse of :func:`group_record`. The states are taken as recorded (they went
    through the transition table when they were made)."""
    tr = d["transition"]
    return Group(d["name"], list(d["ranks"]), [SlotState(s) for s in d["states"]],
                 OnFailure(d["on_failure"]), epoch=d["epoch"], max_epoch=d["max_epoch"],
                 active=set(d["active"]),
                 transition=None if tr is None else transition_from_record(tr),
                 pending_dead=set(d["pending_dead"]), pending_admit=set(d["pending_admit"]),
                 pending_remove=set(d["pending_remove"]),
                 requests={k: list(v) for k, v in d["requests"].items()},
                 joined_from={int(s): SlotState(st) for s, st in d["joined_from"].items()})


@dataclass(frozen=True)
class MembershipState:
    """One consistent picture of the coordinator's durable state.

    Attributes:
        groups: group name -> :func:`group_record` of it.
        max_world_size: capacity fixed by the first rank's hello (None before it).
        config: the deployment settings node 0 published (JSON text), or None.
        target: ``{"ep_size", "max_ep_size", "up", "down", "members", "retired"}`` of
            the scale target, or None.
        operations: :func:`operations_record` of the operation log, or None (none yet).
        limits: ``{"min_holding_ranks", "scale_timeout_s"}`` node 0 published, or None.
        pids: global rank (as text) -> pid of each live rank process: a new leader shows
            them (and routes to them) while the ranks reconnect, and takes a rank back
            only as that process. Absent from states written before it existed.
        nodes: global rank (as text) -> the node of its last launch: a new leader shows
            them, and a node's retirement and its handed-over members are found by
            them, before every launcher has reconnected. Absent from older states.
    """

    groups: dict[str, dict] = field(default_factory=dict)
    max_world_size: int | None = None
    config: str | None = None
    target: dict | None = None
    operations: dict | None = None
    limits: dict | None = None
    pids: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys), so equal states give equal text."""
        return json.dumps({"format": FORMAT, "groups": self.groups,
                           "max_world_size": self.max_world_size, "config": self.config,
                           "target": self.target, "operations": self.operations,
                           "limits": self.limits, "pids": self.pids, "nodes": self.nodes},
                          sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str | bytes) -> MembershipState:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: not JSON, or a format this version does not know.
        """
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"membership state of unknown format "
                             f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r}"
                             f" (this version reads format {FORMAT})")
        # operations, limits, pids and nodes came later within format 1: absent in an
        # older text
        return MembershipState(d["groups"], d["max_world_size"], d["config"], d["target"],
                               d.get("operations"), d.get("limits"), d.get("pids") or {},
                               d.get("nodes") or {})

    def group(self, name: str) -> Group:
        """A fresh :class:`Group` built from the record of ``name`` (KeyError if none)."""
        return group_from_record(self.groups[name])

    def scale_target(self) -> ScaleTarget | None:
        t = self.target
        if t is None:
            return None
        members = t.get("members")
        return ScaleTarget(t["ep_size"], t["max_ep_size"], set(t["up"]), set(t["down"]),
                           None if members is None else set(members),
                           set(t.get("retired", ())))

    def apply_deployment(self, d: DeploymentRecords, now: float) -> None:
        """Take over the deployment's config, target, limits and operations into ``d``
        (a new leader's records); a grow still waiting for joiners gets a full scale
        timeout from ``now`` (clock seconds of the new leader)."""
        d.config = self.config
        d.nodes.update({int(r): node for r, node in self.nodes.items()})
        d.target = self.scale_target()
        d.operations = self.operation_log()
        if self.limits is not None:
            d.min_holding_ranks = self.limits["min_holding_ranks"]
            d.scale_timeout_s = self.limits["scale_timeout_s"]
        if d.target is not None and d.target.up:
            d.target.deadline = now + d.scale_timeout_s

    def operation_log(self) -> OperationLog:
        """A fresh :class:`OperationLog` from :attr:`operations` (empty if None)."""
        d = self.operations
        if d is None:
            return OperationLog()
        return OperationLog(
            {o["id"]: Operation(o["id"], dict(o["request"]), tuple(o["slots"]), o["leaving"],
                                dict(o["reply"])) for o in d["ops"]},
            set(d["timed_out"]), set(d["superseded"]), d["next_id"])


def target_record(t: ScaleTarget | None) -> dict | None:
    """JSON-able form of a scale target (None stays None)."""
    if t is None:
        return None
    return {"ep_size": t.ep_size, "max_ep_size": t.max_ep_size, "up": _slots(t.up),
            "down": _slots(t.down), "members": _slots(t.members or set()),
            "retired": _slots(t.retired)}


def operations_record(log: OperationLog) -> dict | None:
    """JSON-able form of the operation log, in the order the operations came (None
    while it is empty and has made up no id)."""
    if not log.ops and log.next_id == 1:
        return None
    return {"ops": [{"id": o.id, "request": o.request, "slots": list(o.slots),
                     "leaving": o.leaving, "reply": o.reply} for o in log.ops.values()],
            "timed_out": sorted(log.timed_out), "superseded": sorted(log.superseded),
            "next_id": log.next_id}


def deployment_fields(d: DeploymentRecords) -> dict:
    """The :class:`MembershipState` fields of the deployment's records: ``config``,
    ``target``, ``operations`` and ``limits`` (None before node 0 published them), and
    ``nodes``."""
    limits = None if d.target is None else {"min_holding_ranks": d.min_holding_ranks,
                                            "scale_timeout_s": d.scale_timeout_s}
    return {"config": d.config, "target": target_record(d.target),
            "operations": operations_record(d.operations), "limits": limits,
            "nodes": {str(r): node for r, node in sorted(d.nodes.items())}}
