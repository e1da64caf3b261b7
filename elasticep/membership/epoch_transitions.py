"""Epoch transitions of a group: a rank's death, then announce -> collect the members'
reports -> :func:`~elasticep.membership.transitions.decide` -> commit, and the ``Peer``
pushes that tell members of a slot state change between epochs.

A mixin of :class:`~elasticep.membership.service.MembershipService`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from . import messages as m
from .registry import Group, Transition
from .takeover import RankProc as _Proc
from .transitions import Decision, SlotState, decide, state_after_death

log = logging.getLogger("elasticep.membership")


def log_commit(group: str, d: Decision) -> None:
    """The line that says epoch ``d.epoch`` of ``group`` is committed (the chaos
    invariants read it: ``elasticep_testkit.chaos.invariants``)."""
    log.info("coordinator: group %s commit epoch %d %s", group, d.epoch, d.to_dict())


class EpochTransitions:
    """The transition steps of :class:`~elasticep.membership.service.MembershipService`;
    every one reads or changes its groups and queues messages with ``_send``."""

    _groups: dict[str, Group]
    _procs: dict[int, _Proc]
    _send: Callable[..., None]
    _admit_into_empty: Callable[[Group], None]
    changes_allowed: Callable[[], bool]
    on_decided: Callable[[str, Decision], None] | None
    _deferred: bool

    def _proc_dead(self, proc: _Proc, why: str, start: bool = True) -> None:
        """``proc`` died; ``start``: begin its groups' failure transition now (False: the
        caller does, once it has recorded every death it knows of, so that they share
        one epoch)."""
        if not proc.alive:
            return
        proc.alive = False
        removed = bool(proc.groups) and all(
            self._groups[n].states[self._groups[n].slot_of(proc.rank)] == SlotState.FREE
            for n in proc.groups)  # a planned removal already took its slots: no failure
        log.log(logging.INFO if removed else logging.WARNING,
                "coordinator: rank %d (pid %d) %s: %s", proc.rank, proc.pid,
                "left after its planned removal" if removed else "dead", why)
        for name in proc.groups:
            g = self._groups[name]
            slot = g.slot_of(proc.rank)
            leaving = g.leaving(slot)
            member = slot in g.active or bool(g.transition and slot in g.transition.new_active)
            if member:
                g.pending_dead.add(slot)  # a leaving member leaves through a failure too
            g.set_state(slot, state_after_death(g.states[slot], leaving, member,
                                                g.joined_from.get(slot)))
            g.pending_admit.discard(slot)
            if start:
                self._maybe_start(g)
            if leaving:
                # Its removal is done by the failure transition; a removal left queued (a
                # restarted change transition re-queues it) would fire again when the slot
                # is next admitted by a scale-up.
                g.pending_remove.discard(slot)
                g.requests["remove"] = [r for r in g.requests["remove"] if r != slot]
            self._push_peer(g)

    def _maybe_start(self, g: Group) -> None:
        tr = g.transition
        if tr is not None:
            if g.pending_dead - tr.dead:
                self._announce(g, tr.restart(g))
            return
        if not (g.pending_dead & g.active) and not self.changes_allowed():
            # A planned change waits while its commit could not be stored: announced,
            # it would hold every member at the boundary until the store came back. A
            # death cannot wait: the group is stuck anyway.
            self._deferred = True
            return
        tr = Transition.begin(g)
        if tr is not None:
            self._announce(g, tr)

    def _announce(self, g: Group, tr: Transition) -> None:
        g.transition = tr
        tr.waiting = {s for s in g.active if self._alive_slot(g, s)}
        log.info("coordinator: group %s announce epoch %d kind=%s active=%s dead=%s",
                 g.name, tr.epoch, tr.kind, sorted(tr.new_active), sorted(tr.dead))
        for s in tr.waiting:
            self._send(self._procs[g.ranks[s]].conn, m.Announce(g.name, tr.epoch))
        self._maybe_commit(g)

    def _maybe_commit(self, g: Group) -> None:
        tr = g.transition
        if tr is None or not tr.waiting <= set(tr.reports):
            return
        d = decide(tr.kind, tr.epoch, tr.new_active, tr.dead, tr.reports)
        g.commit(tr)
        if self.on_decided is None:
            log_commit(g.name, d)
        else:  # committed once the store has it: the server logs it then
            log.info("coordinator: group %s decided epoch %d (sent once the membership "
                     "store has it)", g.name, d.epoch)
            self.on_decided(g.name, d)
        # Requests travel with the commit: a rank must not act again on a removal or
        # admission that this commit just applied (a later re-admission of the slot
        # would otherwise be undone by the stale request).
        msg = m.Commit(g.name, g.states, self._requests_view(g), decision=d)
        for p in self._procs.values():
            if p.alive and g.name in p.groups:
                self._send(p.conn, msg)
        self._maybe_start(g)
        if g.transition is None:
            self._admit_into_empty(g)  # the last member's death may have just committed

    def _alive_slot(self, g: Group, slot: int) -> bool:
        p = self._procs.get(g.ranks[slot])
        return p is not None and p.alive

    def _push_peer(self, g: Group) -> None:
        msg = m.Peer(g.name, g.states, self._requests_view(g))
        for p in self._procs.values():
            if p.alive and g.name in p.groups:
                self._send(p.conn, msg)

    def _requests_view(self, g: Group) -> dict[str, list[int]]:
        """The requests the members see. While a planned change may not begin
        (``changes_allowed``), admissions and removals stay with the coordinator: a
        member that saw one would drain and then wait at the boundary for a commit the
        store cannot take, and serving would stop; they are pushed once it may."""
        if self.changes_allowed() or not (g.requests.get("admit") or g.requests.get("remove")):
            return g.requests
        self._deferred = True
        return {**g.requests, "admit": [], "remove": []}
