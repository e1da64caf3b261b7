"""The coordinator server: sockets, threads and the store around `MembershipService`.

It hosts the rendezvous TCPStore, keeps one control connection per rank (EOF there means
death within milliseconds), runs the heartbeat clock (a frozen rank is evicted after
`hb_timeout_s`) and hands every event to the pure :class:`MembershipService`, then
sends the messages it returns, all under one lock so that every connection sees
the service's messages in the order it produced them.

Start it with `start_coordinator()` (in-process threads; fine for tests), as the child
process `serve` and `generate` run (``process.CoordinatorProcess``, so that no stall of
theirs starves heartbeats), or standalone: ``python -m elasticep.membership.server
--host H --port P``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import signal
import socket
import threading
import time

import torch.distributed as dist

from . import messages as m
from .commit_gate import CommitGate
from .durable_state import MembershipState
from .election import LeaderLease
from .epoch_transitions import log_commit
from .errors import MembershipStoreError
from .lease_watch import LiveRanks
from .persister import StatePersister, StoreHealth
from .protocol import Connection
from .service import MembershipService, SendOnConn
from .status import StoreStatus
from .store import MembershipStore
from .transitions import Decision

log = logging.getLogger("elasticep.membership")

VANISHED_POLL_S = 0.05  # after a takeover: how often etcd's list of rank processes is read


class Coordinator:
    """Membership server. Use `start_coordinator`; `.address` is ``"host:port"``.

    Args:
        host: interface to bind (loopback by default).
        port: control port (0 picks a free one). The store port is always picked freely.
        hb_interval_s: heartbeat period ranks are told to use (seconds).
        hb_timeout_s: an active rank silent this long is evicted (seconds).
        join_hb_timeout_s: the same for joining/ready ranks that are loading weights.
        listener: a socket already bound on ``host`` to listen and accept on instead of
            binding ``port`` (the parent of a coordinator process binds it, so that a
            bind error is its own and the address is known before the child is up; it
            listens only from here on, so nobody is accepted before the service runs).
        membership_store: where the durable state is committed after each change
            (``store.py``; claimed by the caller). Its committed state, if any, is
            taken over first. None: memory only (the embedded default).
        lease: this replica's leader lease, shown in the status while it holds it.
        rank_processes: with a store, the rank processes etcd lists whose lease has not
            run out (``lease_watch.LiveRanks``, started: it watched the old leader's
            host before this replica led; closed here once no member is awaited). After
            a takeover, a member not back yet is failed as soon as its process is not
            listed (``takeover.py``); None: every member gets its heartbeat timeout.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, hb_interval_s: float = 0.2,
                 hb_timeout_s: float = 2.0, join_hb_timeout_s: float = 30.0,
                 listener: socket.socket | None = None,
                 membership_store: MembershipStore | None = None,
                 lease: LeaderLease | None = None,
                 rank_processes: LiveRanks | None = None) -> None:
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.service = MembershipService(self.store.port, hb_interval_s, hb_timeout_s,
                                         join_hb_timeout_s)
        self._lock = threading.RLock()
        self._persister: StatePersister | None = None
        # with a store: epoch commits wait until it holds them (commit_gate.py); the
        # events are numbered, and each snapshot the persister takes keeps its number
        self._gate: CommitGate | None = None
        self._change = 0
        self._snapshots: list[tuple[MembershipState, int]] = []
        self._decided: list[tuple[str, Decision]] = []  # by the event being handled
        if membership_store is not None:
            state, revision = membership_store.load()
            if state is not None:
                self.service.restore(state)
            self._gate = CommitGate()
            self._persister = StatePersister(membership_store, self._durable_state,
                                             revision, on_committed=self._committed,
                                             on_fenced=self._refuse_held)
            self.service.store_status = self._store_status
            self.service.changes_allowed = self._changes_allowed
            self.service.on_decided = lambda group, d: self._decided.append((group, d))
        self._lease = lease
        if listener is None:
            listener = socket.create_server((host, port))
        else:
            listener.listen()  # connects were refused until now (see the argument)
        self._lsock = listener
        self.address = f"{host}:{self._lsock.getsockname()[1]}"
        self._conns: dict[int, Connection] = {}
        self._ids = itertools.count(1)
        self._closed = False
        for target in (self._accept_loop, self._monitor_loop):
            threading.Thread(target=target, daemon=True, name=f"coord-{target.__name__}").start()
        if rank_processes is not None and self.service.awaiting_resume:
            threading.Thread(target=self._fail_vanished, args=(rank_processes,), daemon=True,
                             name="coord-vanished").start()
        elif rank_processes is not None:
            rank_processes.close()
        log.info("coordinator up at %s (store port %d)", self.address, self.store.port)

    def begin_stop(self) -> None:
        """The deployment is being stopped on purpose: from now on a rank that exits or
        falls silent is not a failure (no eviction, no epoch, no warning), so a normal
        shutdown does not read like a cascade of deaths. Call before killing the ranks."""
        with self._lock:
            self.service.begin_stop()

    def store_health(self) -> StoreHealth | None:
        """The membership store's health (None without ``membership_store``)."""
        return None if self._persister is None else self._persister.health()

    def wait_committed(self, timeout_s: float) -> bool:
        """Block until the membership as of now is in the store (True at once without
        one); False after ``timeout_s`` seconds."""
        return self._persister is None or self._persister.wait_committed(timeout_s)

    def _store_status(self) -> StoreStatus | None:
        h = self.store_health()
        if h is None:
            return None
        lease = self._lease
        leader = lease.candidate if lease is not None and lease.is_leader else None
        return StoreStatus("etcd", h.ok, h.reason, h.revision, leader)

    def _changes_allowed(self) -> bool:
        # while the store takes commits and this replica leads (it may be cut off from
        # the store's majority before a commit has failed: the lease runs out first)
        assert self._persister is not None
        return self._persister.health().ok and (self._lease is None or self._lease.is_leader)

    def _durable_state(self) -> MembershipState:
        with self._lock:
            state = self.service.durable_state()
            self._snapshots = [*self._snapshots[-15:], (state, self._change)]
            return state

    def _committed(self, state: MembershipState) -> None:
        """The store holds ``state`` (the persister's thread): release the commits it
        contains."""
        assert self._gate is not None  # the persister that calls this comes with it
        with self._lock:
            done = max((c for s, c in self._snapshots if s == state), default=None)
            if done is None:
                return
            self._snapshots = [(s, c) for s, c in self._snapshots if c > done]
            sends = self._gate.confirm(done)
            for group, d in self._gate.take_committed():  # logged before any rank has it
                log_commit(group, d)
            self._send(sends)

    def _refuse_held(self, reason: str) -> None:
        """Nothing commits from now on (deposed, or closing): say which decided epochs
        no rank received."""
        with self._lock:
            refused = [] if self._gate is None else self._gate.refuse()
        for group, d in refused:
            log.warning("coordinator: group %s epoch %d refused, never sent: %s", group,
                        d.epoch, reason)

    def close(self) -> None:
        """Stop serving: close the listener and every connection (ranks see EOF)."""
        if self._persister is not None:
            self._persister.close()
            self._refuse_held("the coordinator closed before the membership store had it")
        with self._lock:
            self._closed = True
            self.service.close()
            conns = [self._conns[c] for c in self.service.rank_connections()
                     if c in self._conns]
        try:
            self._lsock.close()
        except OSError:
            pass
        for c in conns:
            c.close()

    def _deliver(self, sends: list[SendOnConn], changed: bool = True) -> None:
        """Send the service's commands in order (the caller holds the lock), and have
        the state committed if the event may have ``changed`` it; with a store, an
        epoch commit and what follows it on its connection wait for the store."""
        if changed and self._persister is not None:
            self._change += 1
            self._persister.changed()
        if self._gate is not None:
            sends = self._gate.route(sends, self._change)
            decided, self._decided = self._decided, []
            for group, d in decided:
                if self._gate.decided((group, d), self._change):
                    log_commit(group, d)
        self._send(sends)

    def _send(self, sends: list[SendOnConn]) -> None:
        for s in sends:
            conn = self._conns.get(s.conn)
            if conn is None:
                continue
            conn.send(s.msg)
            if s.close:
                conn.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(Connection(sock),), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with self._lock:
            cid = next(self._ids)
            self._conns[cid] = conn
        while True:
            try:
                msg = conn.recv()
            except m.ProtocolError as e:
                with self._lock:
                    self._deliver(self.service.malformed(cid, e))
                continue
            if msg is None:
                break
            with self._lock:
                self._deliver(self.service.handle(cid, msg),
                              changed=not isinstance(msg, m.Heartbeat))
        conn.close()
        with self._lock:
            self._deliver(self.service.closed(cid))
            del self._conns[cid]
            if self._gate is not None:
                self._gate.drop(cid)

    def _fail_vanished(self, rank_processes: LiveRanks) -> None:
        """After a takeover, until every member is back or failed: fail those whose
        process etcd stopped listing or whose lease ran out. Their keys' leases run out
        about when the old leader's did, some just after this replica won it, hence a
        poll, not one look."""
        try:
            self._poll_vanished(rank_processes)
        finally:
            rank_processes.close()

    def _poll_vanished(self, rank_processes: LiveRanks) -> None:
        while not self._closed:
            try:
                live = rank_processes()
            except MembershipStoreError as e:  # nothing known: the deadlines still run
                log.debug("coordinator: cannot list the rank processes: %s", e)
                live = None
            with self._lock:
                if live is not None:
                    sends = self.service.vanished(live)
                    self._deliver(sends, changed=bool(sends))
                if not self.service.awaiting_resume:
                    return
            time.sleep(VANISHED_POLL_S)

    def _monitor_loop(self) -> None:
        svc = self.service
        period = min(svc.hb_interval_s, svc.hb_timeout_s) / 2
        last = time.monotonic()
        while not self._closed:
            time.sleep(period)
            now = time.monotonic()
            stalled_s, last = now - last - period, now
            with self._lock:
                # not mere scheduling jitter: this process did not run
                stalled = stalled_s if stalled_s > svc.hb_timeout_s / 2 else 0.0
                sends = svc.tick(now, stalled)
                self._deliver(sends, changed=bool(sends))


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
