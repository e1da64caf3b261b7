"""A new leader taking the ranks back from the coordinator it replaces
(``--membership-store``, standby coordinators).

A mixin of :class:`~elasticep.membership.service.MembershipService`. After
:meth:`restore` the new leader knows every group's membership but has no connection:
each member of the restored state gets a placeholder record, as if it had just said
hello, so that

- its heartbeat deadline starts at the leader change (no rank is evicted for the
  leader's own absence), and one that never comes back is evicted after the usual
  heartbeat timeout, through the usual failure transition;
- but a rank whose process etcd no longer lists (its ``ranks/<rank>`` key,
  ``directory.announce_rank``, expired with the lease that process kept alive, or names
  another pid) is failed at once, in the new leader's first epoch (:meth:`vanished`):
  its process is gone (its host often died with the old leader), and a heartbeat
  timeout spent waiting for it would only lengthen the survivors' pause;
- a rank that lost its leader and says hello again with ``resume``
  (:class:`~elasticep.membership.messages.RankHello`) is taken back as the member it
  was: same slot, same groups, same epochs, no new epoch for it.

A transition that was in flight when the old leader died is restarted at a fresh epoch
once its first member is back (its reports answered the old leader's announcement);
members that come back later are sent its announcement. A rank at an epoch the store
does not hold (the old leader committed it in memory and died before its write-behind
reached etcd), or waiting for a commit that never came, makes the new leader announce a
fresh epoch over the stored active set, so that every member converges on one
membership at an epoch newer than anything it saw.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import messages as m
from .durable_state import MembershipState
from .handlers import Role
from .registry import Group, Transition
from .transitions import ACTIVE_STATES, SlotState, TransitionKind

log = logging.getLogger("elasticep.membership")

# slot states whose rank the new leader waits for after a takeover
HELD_STATES = ACTIVE_STATES | {SlotState.JOINING, SlotState.READY}
# placeholder connection ids: below every id a server hands out (those start at 1), so
# whatever is sent to a rank not back yet is dropped
_NO_CONN = -1


@dataclass
class RankProc:
    """A rank process as the coordinator knows it; ``resuming``: a placeholder of a
    member of the restored state that has not said hello to this leader yet."""

    ROLE = Role.RANK

    rank: int
    pid: int
    conn: int
    alive: bool = True
    last_hb: float = 0.0
    groups: set[str] = field(default_factory=set)
    resuming: bool = False


class Takeover:
    """See the module docstring. Needs the service's groups, procs, clock, sends and
    transition starts."""

    _groups: dict[str, Group]
    _procs: dict[int, RankProc]
    _max_world_size: int | None
    _clock: Callable[[], float]
    _deployment: Any
    _send: Callable[..., None]
    _announce: Callable[[Group, Transition], None]
    _takeover: set[str]
    _proc_dead: Callable[..., None]
    _maybe_start: Callable[[Group], None]
    _flush: Callable[[], list[Any]]

    def restore(self, state: MembershipState) -> None:
        """Take over ``state`` as a new leader, before any rank reconnects: groups,
        capacity, the deployment's config, target, limits and operations (a waiting grow
        gets a full scale timeout), and a placeholder for every rank the state holds a
        slot for, with the pid it names (see the module docstring). A transition that
        was in flight is restarted at a fresh epoch once its first member is back."""
        now = self._clock()
        self._groups = {n: state.group(n) for n in state.groups}
        self._max_world_size = state.max_world_size
        state.apply_deployment(self._deployment, now)
        for g in self._groups.values():
            for slot, rank in enumerate(g.ranks):
                if rank < 0 or g.states[slot] not in HELD_STATES:
                    continue
                p = self._procs.get(rank)
                if p is None:
                    p = self._procs[rank] = RankProc(rank, state.pids.get(str(rank), 0),
                                                     _NO_CONN - rank, last_hb=now,
                                                     resuming=True)
                p.groups.add(g.name)
        self._takeover = {n for n, g in self._groups.items() if g.transition is not None}

    @property
    def awaiting_resume(self) -> bool:
        """Some member of the restored state is alive here but has not said hello yet."""
        return any(p.resuming and p.alive for p in self._procs.values())

    def vanished(self, live: dict[int, int]) -> list[Any]:
        """Fail every member not back yet whose process is not in ``live`` (global rank
        -> pid of the rank processes etcd lists with a lease that has not run out,
        ``lease_watch.LiveRanks``), through
        the usual failure transition; members still listed keep their placeholder and
        its deadline. Returns the messages to send (``SendOnConn``), in order."""
        def listed(p: RankProc) -> bool:  # (a state without the pid: any process)
            return p.rank in live and (not p.pid or live[p.rank] == p.pid)

        gone = [p for p in self._procs.values() if p.resuming and p.alive and not listed(p)]
        for p in gone:
            self._proc_dead(p, "its process left etcd's list of ranks (its lease ran out) "
                            "before it came back after the leader change", start=False)
        for name in sorted({n for p in gone for n in p.groups}):
            self._maybe_start(self._groups[name])  # one epoch for every death seen here
        return self._flush()

    def _resume_refusal(self, msg: m.RankHello) -> str | None:
        """Why the resuming hello ``msg`` cannot be taken back (None: it can)."""
        p = self._procs.get(msg.rank)
        if msg.max_world_size != self._max_world_size:
            return (f"max_world_size {msg.max_world_size} != coordinator's "
                    f"{self._max_world_size}")
        if p is None or not p.alive:
            return (f"slot {msg.rank} holds no member in the membership this coordinator "
                    "took over (declared dead meanwhile?)")
        if not p.resuming and msg.pid != p.pid:
            return f"slot {msg.rank} is already held by live pid {p.pid}"
        # (the member's own pid, not resuming: it lost its connection to this
        # coordinator, which had not seen it close yet, and comes back on a new one; as
        # when a stopping leader's ranks reconnect before its key in etcd is gone)
        if p.pid and msg.pid != p.pid:
            return f"slot {msg.rank} was held by pid {p.pid}, not {msg.pid}"
        for name in msg.resume:
            g = self._groups.get(name)
            if g is None or name not in p.groups:
                return f"rank {msg.rank} is no member of group {name!r} here"
        return None

    def _resume(self, conn: int, msg: m.RankHello, body: dict) -> RankProc | None:
        """Answer a resuming hello (reply fields ``body`` when accepted)."""
        why = self._resume_refusal(msg)
        if why is not None:
            log.warning("coordinator: refused rank %d (pid %d) resuming: %s", msg.rank,
                        msg.pid, why)
            self._send(conn, m.Reply(id=msg.id, ok=False, error=why))
            return None
        p = self._procs[msg.rank]
        why_back = "after the leader change" if p.resuming else "on a new connection"
        p.pid, p.conn, p.last_hb, p.resuming = msg.pid, conn, self._clock(), False
        self._send(conn, m.Reply(id=msg.id, ok=True, body=body))
        log.info("coordinator: rank %d (pid %d) is back %s (epochs %s)",
                 msg.rank, msg.pid, why_back, msg.resume)
        for name, (epoch, pending) in sorted(msg.resume.items()):
            self._catch_up(self._groups[name], p, epoch, pending)
        return p

    def _catch_up(self, g: Group, p: RankProc, epoch: int, pending: int) -> None:
        """Bring the resumed member ``p`` of ``g``, whose committed epoch is ``epoch``
        and which waits for ``pending`` to commit (0: for none), into the transition
        that decides the group's next epoch, if one is needed."""
        slot = g.slot_of(p.rank)
        if slot not in g.active:
            return  # a joiner: it takes part from its admission on
        seen = max(epoch, pending)
        g.max_epoch = max(g.max_epoch, seen)
        tr = g.transition
        if tr is not None and (g.name in self._takeover or seen >= tr.epoch):
            self._takeover.discard(g.name)
            log.info("coordinator: group %s: restarting the transition in flight", g.name)
            self._announce(g, tr.restart(g))
        elif tr is None and (epoch != g.epoch or pending):
            # (a rank waiting for a commit the old leader never sent would wait forever)
            log.warning("coordinator: group %s: rank %d is at epoch %d (waiting for %d), "
                        "the store holds %d; announcing a fresh epoch over the stored "
                        "members %s", g.name, p.rank, epoch, pending, g.epoch,
                        sorted(g.active))
            g.max_epoch += 1
            self._announce(g, Transition(g.max_epoch, TransitionKind.CHANGE, set(g.active),
                                         set(g.active)))
        elif tr is not None and slot in tr.waiting and slot not in tr.reports:
            self._send(p.conn, m.Announce(g.name, tr.epoch))
