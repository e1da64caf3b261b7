"""Where the time of each death, rejoin and scale went, as the front-end sees it (pure).

:class:`RecoveryTimeline` takes what the front-end observes (membership snapshots, each
rank's committed step outputs, scale requests), with their times, and returns
:class:`Event` s: every slot state change, and the end of each phase with its
duration. ``/metrics`` observes the phases in histograms and ``--event-log`` writes every
event as one JSON line, so the two always agree. No clock, no I/O: callers pass the time.

Phases (seconds; all measured on the front-end's monotonic clock):

* a death, from the snapshot that first shows the slot ``failed`` (``t0``):
  ``detected`` (from the dead rank's last step output to ``t0``: how long the death
  went unnoticed, an upper bound, only for a rank that was producing tokens),
  ``agreed`` (``t0`` to the first snapshot with a newer epoch: the survivors committed
  the failure), ``placement_repaired`` (``t0`` to the first step output in that epoch:
  the survivors repaired the placement and stepped again), ``first_token`` (``t0`` to
  the first token after that);
* a rejoin: ``loaded`` (slot ``joining`` to ``ready``), ``admitted`` (``ready`` to
  ``healthy``), ``pause`` (the gap in step outputs across the epoch change that
  admitted it);
* a scale: from the accepted request to the scale phase ``idle`` again, by kind
  (``grow``, ``shrink``, ``retire``). A grow that a later request replaced while it
  waited for joiners (the coordinator's answer names it ``superseded``) never finishes:
  it ends as ``scale_superseded``; one that gave up waiting (idle again below the size
  it asked for: ``--elastic-ep-scale-timeout``) ends as ``scale_timed_out``. No
  histogram observes either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elasticep.membership.status import DeploymentStatus
from elasticep.membership.transitions import ScalePhase, SlotState

# a rank's last output older than this says nothing of when it died
_DETECT_HORIZON_S = 5.0


@dataclass(frozen=True)
class Event:
    """One thing the front-end saw.

    Attributes:
        t: when (monotonic seconds).
        name: ``rank_state``, ``epoch``, ``scale_requested``, or a phase's end:
            ``death_<phase>``, ``rejoin_<phase>``, ``scale_done``,
            ``scale_superseded``, ``scale_timed_out``.
        attrs: its details (rank, state, epoch, kind, ...), JSON-ready.
        seconds: the phase's duration, for a phase's end; None otherwise.
    """

    t: float
    name: str
    attrs: Mapping[str, Any] = field(default_factory=dict)
    seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the event log (``t`` as given: the caller adds wall time)."""
        out: dict[str, Any] = {"t": round(self.t, 6), "event": self.name, **self.attrs}
        if self.seconds is not None:
            out["seconds"] = round(self.seconds, 6)
        return out


@dataclass
class _Death:
    rank: int
    t0: float
    epoch_before: int
    agreed_epoch: int | None = None
    repaired: bool = False


@dataclass(frozen=True)
class _Scale:
    t: float  # accepted at
    kind: str
    operation_id: str | None
    size: int | None  # the ep_size a grow asked for


@dataclass
class RecoveryTimeline:
    """The open deaths, joins and scales, and what was last seen (see the module doc)."""

    states: dict[int, SlotState] = field(default_factory=dict)
    epoch: int | None = None
    deaths: list[_Death] = field(default_factory=list)
    joining_since: dict[int, float] = field(default_factory=dict)
    ready_since: dict[int, float] = field(default_factory=dict)
    admitted_at: dict[int, int] = field(default_factory=dict)  # rank -> its epoch
    scales: list[_Scale] = field(default_factory=list)
    last_output: dict[int, float] = field(default_factory=dict)  # rank -> time
    last_step: tuple[float, int] | None = None  # (time, epoch) of the latest output

    def on_status(self, now: float, status: DeploymentStatus) -> list[Event]:
        """A membership snapshot arrived at ``now``."""
        events: list[Event] = []
        for entry in status.ranks:
            old = self.states.get(entry.rank)
            new = entry.state
            if old == new:
                continue
            self.states[entry.rank] = new
            if old is None and new in (SlotState.HEALTHY, SlotState.FREE):
                continue  # the first snapshot: nothing changed
            events.append(Event(now, "rank_state", {
                "rank": entry.rank, "state": new.value, "from": getattr(old, "value", None),
                "node": entry.node, "epoch": status.epoch}))
            events += self._slot_changed(now, entry.rank, old, new)
        if self.epoch is not None and status.epoch > self.epoch:
            events.append(Event(now, "epoch", {"epoch": status.epoch}))
            for d in self.deaths:
                if d.agreed_epoch is None and status.epoch > d.epoch_before:
                    d.agreed_epoch = status.epoch
                    events.append(self._phase(now, "death_agreed", d.t0,
                                              rank=d.rank, epoch=status.epoch))
        self.epoch = status.epoch if self.epoch is None else max(self.epoch, status.epoch)
        if self.scales and status.scale_phase == ScalePhase.IDLE:
            for s in self.scales:
                short = s.size is not None and status.ep_size < s.size
                events.append(self._phase(now, "scale_timed_out" if short else "scale_done",
                                          s.t, kind=s.kind, operation_id=s.operation_id,
                                          ep_size=status.ep_size))
            self.scales = []
        return events

    def _slot_changed(self, now: float, rank: int, old: SlotState | None,
                      new: SlotState) -> list[Event]:
        events: list[Event] = []
        if new == SlotState.FAILED:
            last = self.last_output.get(rank)
            self.deaths.append(_Death(rank, now, self.epoch or 0))
            if last is not None and now - last < _DETECT_HORIZON_S:
                events.append(self._phase(now, "death_detected", last, rank=rank))
        elif new == SlotState.JOINING:
            self.joining_since[rank] = now
        elif new == SlotState.READY:
            start = self.joining_since.pop(rank, None)
            self.ready_since[rank] = now
            if start is not None:
                events.append(self._phase(now, "rejoin_loaded", start, rank=rank))
        elif new == SlotState.HEALTHY and old in (SlotState.READY, SlotState.JOINING):
            start = self.ready_since.pop(rank, None)
            self.joining_since.pop(rank, None)
            self.admitted_at[rank] = self.epoch or 0
            if start is not None:
                events.append(self._phase(now, "rejoin_admitted", start, rank=rank))
        return events

    def on_output(self, now: float, rank: int, epoch: int, tokens: int) -> list[Event]:
        """Rank ``rank`` published a committed step of ``epoch`` with ``tokens`` tokens."""
        events: list[Event] = []
        self.last_output[rank] = now
        for d in list(self.deaths):
            if d.agreed_epoch is None or epoch < d.agreed_epoch:
                continue
            if not d.repaired:
                d.repaired = True
                events.append(self._phase(now, "death_placement_repaired", d.t0,
                                          rank=d.rank, epoch=epoch))
            if tokens:
                self.deaths.remove(d)
                events.append(self._phase(now, "death_first_token", d.t0, rank=d.rank,
                                          epoch=epoch))
        if self.last_step is not None and epoch > self.last_step[1]:
            joined = sorted(r for r, e in self.admitted_at.items() if e < epoch)
            if joined:
                for r in joined:
                    del self.admitted_at[r]
                events.append(self._phase(now, "rejoin_pause", self.last_step[0],
                                          ranks=joined, epoch=epoch))
        if self.last_step is None or epoch >= self.last_step[1]:
            self.last_step = (now, epoch)
        return events

    def on_scale(self, now: float, kind: str, attrs: Mapping[str, Any]) -> list[Event]:
        """A scale of ``kind`` (grow, shrink, retire) was accepted at ``now``; ``attrs``
        is the coordinator's answer (``operation_id``, and ``superseded``: the open
        grows it replaced, which end here untimed)."""
        events = [Event(now, "scale_requested", {"kind": kind, **attrs})]
        gone = set(attrs.get("superseded", ()))
        for s in [s for s in self.scales if s.operation_id in gone]:
            self.scales.remove(s)
            events.append(self._phase(now, "scale_superseded", s.t, kind=s.kind,
                                      operation_id=s.operation_id))
        size = (attrs.get("old_ep_size", 0) + len(attrs.get("slots", ()))
                if kind == "grow" else None)
        self.scales.append(_Scale(now, kind, attrs.get("operation_id"), size))
        return events

    @staticmethod
    def _phase(now: float, name: str, since: float, **attrs: Any) -> Event:
        return Event(now, name, attrs, max(0.0, now - since))
