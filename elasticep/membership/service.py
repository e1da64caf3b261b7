"""The membership service: every decision of the coordinator, with no sockets or threads.

It owns the membership of every group (epochs, slot states through the transition
table, transitions announce -> collect reports -> `transitions.decide` -> commit, in
``epoch_transitions.py``) and the deployment records, and answers supervisors
(``supervisor_requests.py``). Each handler takes one event (a message from a
connection, a closed connection, a clock tick) and RETURNS the :class:`SendOnConn`
commands the caller must deliver, in order, like ``frontend/request_tracker.py``. Connections are plain ids chosen by the caller.

The socket server around it (accept loop, one reader thread per connection, the
heartbeat clock, the rendezvous TCPStore) is ``server.py``; tests drive this class
directly.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import messages as m
from .durable_state import MembershipState, deployment_fields, group_record
from .epoch_transitions import EpochTransitions
from .errors import MembershipRequestError
from .handlers import Role, dispatch, handler_table, handles
from .registry import DeploymentRecords, Group
from .supervisor_requests import SupervisorRequests
from .takeover import RankProc as _Proc
from .takeover import Takeover
from .transitions import ACTIVE_STATES, Decision, Report, SlotState

log = logging.getLogger("elasticep.membership")


@dataclass(frozen=True)
class SendOnConn:
    """A command for the caller: send ``msg`` on connection ``conn`` (best effort),
    then close that connection if ``close``."""

    conn: int
    msg: m.ControlMessage
    close: bool = False


@dataclass(eq=False)
class _Supervisor:
    """A supervisor connection (launcher, front-end, `join`): what it records (launches,
    reservations) lives as long as it stays connected."""

    ROLE = Role.SUPERVISOR

    id: int
    conn: int


class MembershipService(Takeover, SupervisorRequests, EpochTransitions):
    """The coordinator's state machine; not thread-safe (the server holds one lock).

    Args:
        store_port: port of the rendezvous TCPStore, told to every hello.
        hb_interval_s: heartbeat period ranks are told to use (seconds).
        hb_timeout_s: an active rank silent this long is evicted (seconds).
        join_hb_timeout_s: the same for joining/ready ranks that are loading weights.
        clock: monotonic seconds (injected so tests need no sleeps).
    """

    def __init__(self, store_port: int, hb_interval_s: float = 0.2, hb_timeout_s: float = 2.0,
                 join_hb_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store_port = store_port
        self.hb_interval_s = hb_interval_s
        self.hb_timeout_s = hb_timeout_s
        self.join_hb_timeout_s = join_hb_timeout_s
        self._clock = clock
        self._peers: dict[int, _Proc | _Supervisor] = {}  # connection -> who it is
        self._procs: dict[int, _Proc] = {}
        self._groups: dict[str, Group] = {}
        self._max_world_size: int | None = None
        self._deployment = DeploymentRecords()
        self._supervisors = itertools.count(1)
        self._out: list[SendOnConn] = []
        self._handlers = handler_table(self)
        self._closed = False
        self._stopping = False  # the deployment is shutting down: exits are not failures
        self._takeover: set[str] = set()  # restored groups whose transition awaits a restart
        # whether a planned change (admission, removal) may begin now: the coordinator
        # with a membership store says no while the store cannot take its commit
        self.changes_allowed: Callable[[], bool] = lambda: True
        # with a membership store: told of each epoch decision, which it logs as
        # committed once the store has it (None: logged as committed when decided)
        self.on_decided: Callable[[str, Decision], None] | None = None
        self._deferred = False  # a planned change waited for that: look again at ticks

    # ------------------------------------------------------------------ events
    def handle(self, conn: int, msg: m.ControlMessage) -> list[SendOnConn]:
        """Answer one message that arrived on connection ``conn``.

        A request the service refuses (a bad field, a rank message on a supervisor
        connection, a membership refusal) is answered with a failed :class:`m.Reply`;
        nothing raises.

        Returns:
            The messages to send, in order.
        """
        try:
            self._handle(conn, self._peers.get(conn), msg)
        except Exception as e:  # a bad request must not kill the server
            if isinstance(e, (MembershipRequestError, m.ProtocolError)):
                log.info("coordinator: refused %s: %s", msg.TAG, e)
            else:
                log.exception("coordinator: error handling %s", msg.TAG)
            self._refuse(conn, msg.id, e)
        return self._flush()

    def malformed(self, conn: int, e: m.ProtocolError) -> list[SendOnConn]:
        """A line on ``conn`` was no valid message: refuse it if its id could be read."""
        log.warning("coordinator: bad control message: %s", e)
        self._refuse(conn, e.rid, e)
        return self._flush()

    def closed(self, conn: int) -> list[SendOnConn]:
        """Connection ``conn`` reached EOF: a rank's death (unless stopping), or a
        supervisor's records going away."""
        peer = self._peers.pop(conn, None)
        # (a connection the rank has since replaced by a newer one, a reconnect, is no death)
        if (isinstance(peer, _Proc) and peer.conn == conn
                and not (self._stopping or self._closed)):
            self._proc_dead(peer, "control connection closed")
        elif isinstance(peer, _Supervisor):
            self._deployment.drop_owner(peer.id)
        return self._flush()

    def tick(self, now: float, stalled_s: float = 0.0) -> list[SendOnConn]:
        """Evict every rank silent past its limit at time ``now`` (clock seconds).

        Args:
            stalled_s: how long the caller itself did not run (paused, starved); that
                silence is its own, so it counts against no rank.
        """
        if stalled_s > 0:
            log.warning("coordinator: stalled for %.1f s; not counting that "
                        "silence against any rank", stalled_s)
            for p in self._procs.values():
                p.last_hb += stalled_s
        for p in list(self._procs.values()):
            if not p.alive or self._stopping:
                continue
            active = any(self._groups[g].is_active_rank(p.rank) for g in p.groups)
            limit = self.hb_timeout_s if active else self.join_hb_timeout_s
            if now - p.last_hb > limit:
                log.warning("coordinator: rank %d %s %.2fs, evicting", p.rank,
                            "not back after the leader change for" if p.resuming
                            else "silent", now - p.last_hb)
                self._evict(p, "heartbeat timeout")
        if self._deferred and self.changes_allowed():
            self._deferred = False
            for g in self._groups.values():
                self._maybe_start(g)
                self._push_peer(g)  # the admissions and removals held back
        self._expire_scale(now)
        return self._flush()

    def begin_stop(self) -> None:
        """The deployment is being stopped on purpose: from now on a rank that exits or
        falls silent is not a failure (no eviction, no epoch, no warning)."""
        self._stopping = True

    def close(self) -> None:
        """The server stops: closed connections are no longer deaths."""
        self._closed = True

    def group(self, name: str) -> Group:
        """The registered group ``name`` (its plain records; read them, do not change
        them). Raises ValueError (one line) for a group nobody registered."""
        return self._group(name)

    def durable_state(self) -> MembershipState:
        """What a standby coordinator needs to take over (``durable_state.py``)."""
        return MembershipState({n: group_record(g) for n, g in self._groups.items()},
                               self._max_world_size, **deployment_fields(self._deployment),
                               pids={str(r): p.pid for r, p in self._procs.items()
                                     if p.alive and p.pid})

    def rank_connections(self) -> list[int]:
        """The connection of every rank that said hello (alive or not)."""
        return [p.conn for p in self._procs.values()]

    # ------------------------------------------------------------------ plumbing
    def _send(self, conn: int, msg: m.ControlMessage, close: bool = False) -> None:
        self._out.append(SendOnConn(conn, msg, close))

    def _flush(self) -> list[SendOnConn]:
        out, self._out = self._out, []
        return out

    def _refuse(self, conn: int, rid: int | None, e: Exception) -> None:
        """Answer request ``rid`` (if it has one) with ``e`` as the reason."""
        if rid is not None:
            self._send(conn, m.Reply(id=rid, ok=False, error=str(e),
                                     code=getattr(e, "code", "refused")))

    def _evict(self, p: _Proc, why: str) -> None:
        self._send(p.conn, m.Evicted(why), close=True)
        self._proc_dead(p, why)

    # ------------------------------------------------------------------ requests
    def _handle(self, conn: int, peer: _Proc | _Supervisor | None, msg: m.ControlMessage) -> None:
        if isinstance(msg, m.Heartbeat):
            if isinstance(peer, _Proc):
                peer.last_hb = self._clock()
                self._send(conn, m.HeartbeatAck())
            return
        if isinstance(msg, (m.RankHello, m.SupervisorHello)):
            who = self._hello(conn, msg)
            if who is not None:
                self._peers[conn] = who
            return
        reply = dispatch(self._handlers, peer, msg)
        if reply is not None and msg.id is not None:
            self._send(conn, m.Reply(id=msg.id, ok=True, body=reply))

    def _hello(self, conn: int, msg: m.RankHello | m.SupervisorHello):
        if isinstance(msg, m.SupervisorHello):
            self._send(conn, m.Reply(id=msg.id, ok=True, body={"store_port": self.store_port}))
            return _Supervisor(next(self._supervisors), conn)
        # the eviction limits go to the rank too: it stops on its side after the same
        # silence (a partition cuts both ways, and the rank must not serve on alone)
        body = {"store_port": self.store_port, "hb_interval_s": self.hb_interval_s,
                "hb_timeout_s": self.hb_timeout_s, "join_hb_timeout_s": self.join_hb_timeout_s}
        if msg.resume is not None:
            return self._resume(conn, msg, body)
        rank, mws = msg.rank, msg.max_world_size
        err = None
        if self._max_world_size is None:
            self._max_world_size = mws
        if mws != self._max_world_size:
            err = f"max_world_size {mws} != coordinator's {self._max_world_size}"
        elif not 0 <= rank < mws:
            err = f"rank {rank} outside [0, {mws})"
        elif rank in self._procs and self._procs[rank].alive:
            err = f"slot {rank} is already held by live pid {self._procs[rank].pid}"
        elif msg.is_extension and any(g.is_active_rank(rank) for g in self._groups.values()):
            err = f"slot {rank} is already active; a joiner can only take a failed/free slot"
        if err:
            self._send(conn, m.Reply(id=msg.id, ok=False, error=err))
            return None
        proc = _Proc(rank=rank, pid=msg.pid, conn=conn, last_hb=self._clock())
        self._procs[rank] = proc
        self._send(conn, m.Reply(id=msg.id, ok=True, body=body))
        log.info("coordinator: rank %d (pid %d, extension=%s) connected", rank, proc.pid,
                 msg.is_extension)
        return proc
    @handles(m.Register, Role.RANK)
    def _register(self, proc: _Proc, msg: m.Register) -> dict:
        name = msg.group
        g = self._groups.get(name)
        if g is None:
            if msg.is_extension:
                raise ValueError(f"group {name!r} does not exist; an extension rank can only "
                                 "join an existing group")
            dead = {r for r, p in self._procs.items() if not p.alive}
            g = Group.create(name, msg.global_ranks, msg.active, msg.on_failure, dead)
            self._groups[name] = g
        if msg.is_extension and proc.rank not in g.ranks:
            g.bind_reserved_slot(proc.rank, msg.global_ranks)
        slot = g.slot_of(proc.rank)
        if msg.is_extension:
            if g.states[slot] in ACTIVE_STATES:
                raise ValueError(f"slot {slot} of group {name!r} is already active "
                                 f"(epoch {g.epoch}); refusing joiner pid {proc.pid}")
            g.set_state(slot, SlotState.JOINING)
        elif slot not in g.active and g.states[slot] != SlotState.HEALTHY:
            raise ValueError(f"slot {slot} of group {name!r} is {g.states[slot].value!r} at epoch "
                             f"{g.epoch}; a relaunched rank must use is_extension=True")
        proc.groups.add(name)
        self._push_peer(g)
        return {"epoch": g.epoch, "active": sorted(g.active), "states": g.states,
                "on_failure": g.on_failure, "slot": slot}

    @handles(m.Ready, Role.RANK)
    def _ready(self, proc: _Proc, msg: m.Ready) -> dict:
        g = self._group(msg.group)
        slot = g.slot_of(proc.rank)
        if g.states[slot] not in (SlotState.JOINING, SlotState.READY):
            raise ValueError(f"slot {slot} is {g.states[slot].value!r}, not joining")
        g.set_state(slot, SlotState.READY)
        self._push_peer(g)
        self._admit_into_empty(g)
        return {}

    def _admit_into_empty(self, g: Group) -> None:
        """With no member left (every rank died), nobody can call ``recover_ranks``: the
        ready slots are admitted by the coordinator itself; the first of them then admits
        later joiners at its step boundaries as usual."""
        if g.active:
            return
        ready = {s for s, st in enumerate(g.states) if st == SlotState.READY}
        if ready - g.pending_admit:
            log.info("coordinator: group %s has no member left; admitting ready slots %s",
                     g.name, sorted(ready))
            g.pending_admit |= ready
            self._maybe_start(g)

    @handles(m.Recover, Role.RANK)
    def _recover(self, proc: _Proc, msg: m.Recover) -> dict:
        g = self._group(msg.group)
        admit = [r for r in msg.ranks if g.states[r] == SlotState.READY]
        g.pending_admit.update(admit)
        self._maybe_start(g)
        # Every caller waits for the same set: listed slots that are ready or were
        # admitted by an earlier caller (so all callers return at the same boundary).
        waiting = [r for r in msg.ranks
                   if g.states[r] == SlotState.READY or g.states[r] in ACTIVE_STATES]
        return {"admitting": waiting}

    @handles(m.Deactivate, Role.RANK)
    def _deactivate(self, proc: _Proc, msg: m.Deactivate) -> dict:
        g = self._group(msg.group)
        remove = [r for r in msg.ranks if r in g.active]
        for r in remove:
            g.set_state(r, SlotState.DRAINING)
        g.pending_remove.update(remove)
        self._maybe_start(g)
        return {"removing": remove}

    @handles(m.EpochReport, Role.RANK)
    def _report(self, proc: _Proc, msg: m.EpochReport) -> None:
        g = self._group(msg.group)
        tr = g.transition
        if tr is None or tr.epoch != msg.epoch:
            return None  # a report for a superseded announcement
        slot = g.slot_of(proc.rank)
        tr.reports[slot] = Report(msg.last, msg.started, frozenset(msg.fetchable))
        self._maybe_commit(g)
        return None

    @handles(m.Ping, Role.RANK)
    def _ping(self, proc: _Proc, msg: m.Ping) -> dict:
        return {}
