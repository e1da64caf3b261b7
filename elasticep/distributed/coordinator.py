"""The coordinator: single source of truth for membership, living outside every rank.

It hosts the rendezvous TCPStore, keeps one control connection per rank (EOF there means
death within milliseconds), checks heartbeats (a frozen rank is evicted after
`hb_timeout_s`), runs epoch transitions per group (announce -> collect reports ->
`membership.decide` -> commit) and answers supervisors (`CoordinatorClient`).

Start it with `start_coordinator()` (in-process threads; fine for tests and the launcher)
or as its own process: ``python -m elasticep.distributed.coordinator --host H --port P``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from . import messages as m
from .coordinator_requests import SupervisorRequests
from .errors import MembershipRequestError
from .membership import ACTIVE_STATES, Report, SlotState, decide, state_after_death
from .protocol import Connection
from .registry import DeploymentRecords, Group, Transition

log = logging.getLogger(__name__)


@dataclass
class _Proc:
    ROLE = "rank"

    rank: int
    pid: int
    conn: Connection
    alive: bool = True
    last_hb: float = field(default_factory=time.monotonic)
    groups: set[str] = field(default_factory=set)


@dataclass(eq=False)
class _Supervisor:
    """A supervisor connection (launcher, front-end, `join`): what it records (launches,
    reservations) lives as long as it stays connected."""

    ROLE = "supervisor"

    id: int
    conn: Connection


class Coordinator(SupervisorRequests):
    """Membership server. Use `start_coordinator`; `.address` is ``"host:port"``.

    Args:
        host: interface to bind (loopback by default).
        port: control port (0 picks a free one). The store port is always picked freely.
        hb_interval_s: heartbeat period ranks are told to use (seconds).
        hb_timeout_s: an active rank silent this long is evicted (seconds).
        join_hb_timeout_s: the same for joining/ready ranks that are loading weights.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, hb_interval_s: float = 0.2,
                 hb_timeout_s: float = 2.0, join_hb_timeout_s: float = 30.0) -> None:
        self.hb_interval_s = hb_interval_s
        self.hb_timeout_s = hb_timeout_s
        self.join_hb_timeout_s = join_hb_timeout_s
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self._lsock = socket.create_server((host, port))
        self.address = f"{host}:{self._lsock.getsockname()[1]}"
        self._lock = threading.RLock()
        self._procs: dict[int, _Proc] = {}
        self._groups: dict[str, Group] = {}
        self._max_world_size: int | None = None
        self._deployment = DeploymentRecords()
        self._supervisors = itertools.count(1)
        self._closed = False
        self._stopping = False  # the deployment is shutting down: exits are not failures
        for target in (self._accept_loop, self._monitor_loop):
            threading.Thread(target=target, daemon=True, name=f"coord-{target.__name__}").start()
        log.info("coordinator up at %s (store port %d)", self.address, self.store.port)

    # ------------------------------------------------------------------ plumbing
    def begin_stop(self) -> None:
        """The deployment is being stopped on purpose: from now on a rank that exits or
        falls silent is not a failure (no eviction, no epoch, no warning), so a normal
        shutdown does not read like a cascade of deaths. Call before killing the ranks."""
        with self._lock:
            self._stopping = True

    def close(self) -> None:
        """Stop serving: close the listener and every connection (ranks see EOF)."""
        with self._lock:
            self._closed = True
            procs = list(self._procs.values())
        try:
            self._lsock.close()
        except OSError:
            pass
        for p in procs:
            p.conn.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(Connection(sock),), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        proc: _Proc | _Supervisor | None = None
        while True:
            try:
                msg = conn.recv()
            except m.ProtocolError as e:
                log.warning("coordinator: bad control message: %s", e)
                _refuse(conn, e.rid, e)
                continue
            if msg is None:
                break
            try:
                with self._lock:
                    out = self._handle(conn, proc, msg)
                if out is not None:
                    proc = out
            except Exception as e:  # a bad request must not kill the server
                if isinstance(e, (MembershipRequestError, m.ProtocolError)):
                    log.info("coordinator: refused %s: %s", msg.TAG, e)
                else:
                    log.exception("coordinator: error handling %s", msg.TAG)
                _refuse(conn, msg.id, e)
        conn.close()
        with self._lock:
            if isinstance(proc, _Proc) and not (self._stopping or self._closed):
                self._proc_dead(proc, "control connection closed")
            elif isinstance(proc, _Supervisor):
                self._deployment.drop_owner(proc.id)

    def _monitor_loop(self) -> None:
        period = min(self.hb_interval_s, self.hb_timeout_s) / 2
        last = time.monotonic()
        while not self._closed:
            time.sleep(period)
            now = time.monotonic()
            stalled_s, last = now - last - period, now
            with self._lock:
                if stalled_s > self.hb_timeout_s / 2:  # not mere scheduling jitter
                    # this process did not run (paused, starved): the ranks' silence
                    # meanwhile is its own, so it counts for none of them
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
                        log.warning("coordinator: rank %d silent %.2fs, evicting", p.rank,
                                    now - p.last_hb)
                        p.conn.send(m.Evicted("heartbeat timeout"))
                        p.conn.close()
                        self._proc_dead(p, "heartbeat timeout")

    # ------------------------------------------------------------------ requests
    def _handle(self, conn: Connection, peer: _Proc | _Supervisor | None, msg: m.Message):
        """Answer one message; returns the connection's peer when a hello names it."""
        if isinstance(msg, m.Heartbeat):
            if isinstance(peer, _Proc):
                peer.last_hb = time.monotonic()
                conn.send(m.HeartbeatAck())
            return None
        if isinstance(msg, (m.RankHello, m.SupervisorHello)):
            return self._hello(conn, msg)
        reply = self._dispatch(peer, msg)
        if reply is not None and msg.id is not None:
            conn.send(m.Reply(id=msg.id, ok=True, body=reply))
        return None

    def _hello(self, conn: Connection, msg: m.RankHello | m.SupervisorHello):
        if isinstance(msg, m.SupervisorHello):
            conn.send(m.Reply(id=msg.id, ok=True, body={"store_port": self.store.port}))
            return _Supervisor(next(self._supervisors), conn)
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
            conn.send(m.Reply(id=msg.id, ok=False, error=err))
            return None
        proc = _Proc(rank=rank, pid=msg.pid, conn=conn)
        self._procs[rank] = proc
        # the eviction limits go to the rank too: it stops on its side after the same
        # silence (a partition cuts both ways, and the rank must not serve on alone)
        conn.send(m.Reply(id=msg.id, ok=True, body={
            "store_port": self.store.port, "hb_interval_s": self.hb_interval_s,
            "hb_timeout_s": self.hb_timeout_s, "join_hb_timeout_s": self.join_hb_timeout_s}))
        log.info("coordinator: rank %d (pid %d, extension=%s) connected", rank, proc.pid,
                 msg.is_extension)
        return proc

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
            _bind_reserved_slot(g, proc.rank, msg.global_ranks)
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

    def _deactivate(self, proc: _Proc, msg: m.Deactivate) -> dict:
        g = self._group(msg.group)
        remove = [r for r in msg.ranks if r in g.active]
        for r in remove:
            g.set_state(r, SlotState.DRAINING)
        g.pending_remove.update(remove)
        self._maybe_start(g)
        return {"removing": remove}

    def _report(self, proc: _Proc, msg: m.EpochReport) -> None:
        g = self._group(msg.group)
        tr = g.transition
        if tr is None or tr.epoch != msg.epoch:
            return None  # a report for a superseded announcement
        slot = g.slot_of(proc.rank)
        tr.reports[slot] = Report(msg.last, msg.started, frozenset(msg.fetchable))
        self._maybe_commit(g)
        return None

    def _ping(self, proc: _Proc, msg: m.Ping) -> dict:
        return {}

    # ------------------------------------------------------------------ transitions
    def _proc_dead(self, proc: _Proc, why: str) -> None:
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
            leaving = _leaving(g, slot)
            member = slot in g.active or bool(g.transition and slot in g.transition.new_active)
            if member:
                g.pending_dead.add(slot)  # a leaving member leaves through a failure too
            g.set_state(slot, state_after_death(g.states[slot], leaving, member,
                                                g.joined_from.get(slot)))
            g.pending_admit.discard(slot)
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
        tr = Transition.begin(g)
        if tr is not None:
            self._announce(g, tr)

    def _announce(self, g: Group, tr: Transition) -> None:
        g.transition = tr
        tr.waiting = {s for s in g.active if self._alive_slot(g, s)}
        log.info("coordinator: group %s announce epoch %d kind=%s active=%s dead=%s",
                 g.name, tr.epoch, tr.kind, sorted(tr.new_active), sorted(tr.dead))
        for s in tr.waiting:
            self._procs[g.ranks[s]].conn.send(m.Announce(g.name, tr.epoch))
        self._maybe_commit(g)

    def _maybe_commit(self, g: Group) -> None:
        tr = g.transition
        if tr is None or not tr.waiting <= set(tr.reports):
            return
        d = decide(tr.kind, tr.epoch, tr.new_active, tr.dead, tr.reports)
        g.commit(tr)
        log.info("coordinator: group %s commit epoch %d %s", g.name, d.epoch, d.to_dict())
        # Requests travel with the commit: a rank must not act again on a removal or
        # admission that this commit just applied (a later re-admission of the slot
        # would otherwise be undone by the stale request).
        msg = m.Commit(g.name, g.states, g.requests, decision=d)
        for p in self._procs.values():
            if p.alive and g.name in p.groups:
                p.conn.send(msg)
        self._maybe_start(g)
        if g.transition is None:
            self._admit_into_empty(g)  # the last member's death may have just committed

    def _alive_slot(self, g: Group, slot: int) -> bool:
        p = self._procs.get(g.ranks[slot])
        return p is not None and p.alive

    def _push_peer(self, g: Group) -> None:
        msg = m.Peer(g.name, g.states, g.requests)
        for p in self._procs.values():
            if p.alive and g.name in p.groups:
                p.conn.send(msg)


def _refuse(conn: Connection, rid: int | None, e: Exception) -> None:
    """Answer request ``rid`` (if it has one) with ``e`` as the reason."""
    if rid is not None:
        conn.send(m.Reply(id=rid, ok=False, error=str(e), code=getattr(e, "code", "refused")))


def _bind_reserved_slot(g: Group, rank: int, joiner_ranks: list[int]) -> None:
    """Give a joiner the reserved slot (global rank -1) at which its own list names it;
    unchanged if there is none (`slot_of` then refuses it)."""
    if rank in joiner_ranks:
        slot = joiner_ranks.index(rank)
        if slot < len(g.ranks) and g.ranks[slot] == -1:
            g.ranks[slot] = rank


def _leaving(g: Group, slot: int) -> bool:
    """``slot`` is being scaled away: draining, or its removal is requested or in flight."""
    tr = g.transition
    return (g.states[slot] == SlotState.DRAINING or slot in g.pending_remove
            or slot in g.requests["remove"] or (tr is not None and slot in tr.removed))


def start_coordinator(host: str = "127.0.0.1", port: int = 0, **kwargs) -> Coordinator:
    """Start a coordinator on background threads of this process.

    Args:
        host, port: control endpoint; port 0 picks a free port.
        **kwargs: hb_interval_s, hb_timeout_s, join_hb_timeout_s (seconds).
    Returns:
        The running `Coordinator`; pass `.address` to ranks and supervisors.
    """
    return Coordinator(host, port, **kwargs)


def main(argv: list[str] | None = None) -> None:
    """CLI: run a coordinator until SIGTERM/SIGINT; prints its address on stdout."""
    ap = argparse.ArgumentParser(description="ElasticEP membership coordinator")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--hb-interval-s", type=float, default=0.2)
    ap.add_argument("--hb-timeout-s", type=float, default=2.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    c = start_coordinator(args.host, args.port, hb_interval_s=args.hb_interval_s,
                          hb_timeout_s=args.hb_timeout_s)
    print(c.address, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    c.close()


if __name__ == "__main__":
    main()
