"""A rank's side of a leader change of the coordinator.

With a membership store (``--membership-store etcd://...``) a lost coordinator is a
leader change, not the end: the rank looks the new leader up in etcd, says hello to it
with ``resume`` (its groups and the epochs it saw in each) and goes on as the member it
was, for up to :attr:`~elasticep.distributed.control.RankControl.stall_grace_s`.
Requests waiting for an answer are sent again on the new connection; meanwhile no lease
is fresh, so no step commits. The new leader runs its own rendezvous TCPStore: the
hello's answer names its port, and
:attr:`~elasticep.distributed.control.RankControl.on_resumed` callbacks move the store
clients there. The log lines keep the control connection's logger.

A mixin of :class:`~elasticep.distributed.control.RankControl`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from elasticep.membership import messages as m
from elasticep.membership.errors import MembershipStoreError
from elasticep.membership.protocol import Connection, connect

log = logging.getLogger("elasticep.distributed.control")

RESUME_CONNECT_S = 1.0  # one attempt to reach the leader etcd names (a live one: ms)
RESUME_RETRY_S = 0.1  # between attempts (the old leader's key lives up to its TTL)


class LeaderResume:
    """Finding the new leader and saying hello to it as the member this rank is."""

    rank: int
    address: str
    world_size: int
    max_world_size: int
    stall_grace_s: float
    membership_store: str | None
    resuming: bool
    evicted: str | None
    lost_reason: str
    last_ack: float
    conn: Connection
    groups: dict[str, Any]
    on_resumed: list[Callable[[], None]]
    _ids: itertools.count
    _lock: threading.Lock
    _replies: dict[int, tuple[threading.Event, list, m.ControlMessage]]
    _take_hello: Callable[[m.Reply], None]

    def _seen_epochs(self) -> dict[str, list[int]]:
        """group -> [its committed epoch here, the announced one awaiting a commit or 0]."""
        with self._lock:
            groups = dict(self.groups)
        return {name: [gs.epoch, gs.pending or 0] for name, gs in groups.items()
                if not gs.closed}

    def _resume(self) -> bool:
        """After the connection closed: with a membership store, find the leader in
        etcd and say hello to it as the member this rank is, retrying until
        :attr:`stall_grace_s` has passed. Returns True once resumed (the connection,
        address and store port are the new leader's); False: lost (or refused)."""
        if not self.membership_store or self.evicted:
            return False
        from elasticep.membership.etcd_store import find_coordinator  # etcd only if asked

        self.resuming = True
        log.warning("rank %d: lost the coordinator at %s; finding the new leader through "
                    "etcd (up to %g s)", self.rank, self.address, self.stall_grace_s)
        started = time.monotonic()
        deadline = started + self.stall_grace_s
        while time.monotonic() < deadline:
            try:
                address = find_coordinator(self.membership_store,
                                           max(deadline - time.monotonic(), 0.1), quiet=True)
                conn = connect(address, RESUME_CONNECT_S)
                hello = self._handshake(conn, m.RankHello(
                    self.rank, os.getpid(), self.world_size, self.max_world_size, False,
                    resume=self._seen_epochs(), id=next(self._ids)))
            except (OSError, TimeoutError, ValueError, MembershipStoreError) as e:
                log.debug("rank %d: resume attempt: %s", self.rank, e)
                time.sleep(RESUME_RETRY_S)
                continue
            if not hello.ok:
                conn.close()
                self.evicted = f"the new leader at {address} refused it: {hello.error}"
                log.error("rank %d: %s", self.rank, self.evicted)
                self.resuming = False
                return False
            with self._lock:
                self.conn, self.address = conn, address
                self._take_hello(hello)
                self.last_ack = time.monotonic()
                for _ev, _box, msg in self._replies.values():
                    conn.send(msg)
            self.resuming = False
            log.warning("rank %d: resumed with the coordinator at %s after %.2f s", self.rank,
                        address, time.monotonic() - started)
            with self._lock:
                groups = list(self.groups.values())
            for fn in [gs.on_resumed for gs in groups] + list(self.on_resumed):
                try:
                    fn()
                except Exception:  # a listener's bug must not end the control plane
                    log.exception("rank %d: a resume listener raised", self.rank)
            return True
        self.resuming = False
        self.lost_reason = (f"no coordinator took this rank back within {self.stall_grace_s:g}"
                            f" s after the one at {self.address} was lost")
        return False

    @staticmethod
    def _handshake(conn: Connection, hello: m.RankHello) -> m.Reply:
        """Send ``hello`` on the fresh ``conn`` and read its reply (nothing else comes
        first). Raises TimeoutError / OSError / ProtocolError (a ValueError)."""
        try:
            conn.sock.settimeout(RESUME_CONNECT_S)
            if not conn.send(hello):
                raise OSError("the new leader closed the connection")
            reply = conn.recv()
            conn.sock.settimeout(None)
        except BaseException:
            conn.close()
            raise
        if not isinstance(reply, m.Reply) or reply.id != hello.id:
            conn.close()
            raise OSError("the new leader did not answer the hello")
        return reply
