"""Rank side of the control plane: one connection per process to the coordinator.

A reader thread dispatches pushes (announce, commit, peer, evicted) to the per-group
`GroupState`s and answers announcements with reports at once, so even a rank whose
main thread is busy or idle takes part in every transition. A heartbeat thread sends
``hb`` every interval; `lease_fresh` tells whether an ack arrived recently.

The coordinator evicts a rank it has not heard from for its heartbeat timeout. The rank
applies the same rule from its side: with no ack or reply from the coordinator for that
long, the coordinator is unreachable (a network partition, a one-way cut, or a host
gone without a FIN), and the connection is closed as if it had broken, so that every
wait of this process raises `CoordinatorLostError` at once. A partitioned rank therefore
stops serving at about the moment the coordinator evicts it. It never goes on with
peers on its own side of the cut: they are evicted too, and it could not commit a step
without a fresh lease anyway.

One silence is not a cut: the coordinator's process stalled (``serve`` paused, a GIL
hog, swapping) while its host's kernel still acknowledges what this rank sends. Then
the rank waits, keeping its state, for up to :data:`STALL_GRACE_S`: its steps do not
commit (no fresh lease: :meth:`RankControl.confirm_membership` waits with them), and
they go on once the coordinator answers again. TCP's own acknowledgements tell the two
apart (``TCP_INFO``'s time since the last ACK): a cut or a dead host sends none.

With a membership store (``--membership-store etcd://...``) a lost coordinator is a
leader change, not the end (:mod:`.leader_resume`).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from elasticep.membership import messages as m
from elasticep.membership.errors import CoordinatorLostError, RankEvictedError
from elasticep.membership.protocol import Connection, connect

from .leader_resume import LeaderResume

log = logging.getLogger(__name__)

# Longest wait on a coordinator whose host still acknowledges (seconds), by default:
# serve's default --coordinator-timeout, the time other nodes give a coordinator that
# went away (a rank gets the deployment's own value, see stall_grace_s).
STALL_GRACE_S = 60.0


def stall_grace_s(coordinator_timeout_s: float, heartbeat_timeout_s: float) -> float:
    """How long a rank waits on a stalled coordinator (pure): the deployment's
    ``--coordinator-timeout``, and never less than its heartbeat timeout (a shorter
    grace would end before the silence counts as one)."""
    return max(coordinator_timeout_s, heartbeat_timeout_s)
# byte offsets in Linux's struct tcp_info: tcpi_retransmits (u8: retransmission timeouts
# not yet recovered by an ACK) and tcpi_last_ack_recv (u32, ms since the last ACK)
_TCPI_RETRANSMITS = 2
_TCPI_LAST_ACK_RECV = 56


def acks_fresh(tcp_info: bytes, within_s: float) -> bool:
    """Whether a socket's ``TCP_INFO`` bytes show its peer's kernel taking what this side
    sends (pure): an ACK arrived within ``within_s`` seconds and none of this side's data
    waits on a retransmission timeout. A fresh ACK alone is no evidence: a host that
    cannot hear this side (a one-way cut) still sends it duplicate ACKs while it
    retransmits its own unacknowledged data, for seconds after the cut.

    Raises:
        struct.error: fewer bytes than the fields read.
    """
    (last_ack_ms,) = struct.unpack_from("I", tcp_info, _TCPI_LAST_ACK_RECV)
    return tcp_info[_TCPI_RETRANSMITS] == 0 and last_ack_ms / 1000.0 < within_s


def peer_host_acks(sock: socket.socket, within_s: float) -> bool:
    """True if the kernel at the other end of ``sock`` takes what this side sends
    (:func:`acks_fresh` of Linux ``TCP_INFO``): the host is up and reachable even when
    the process there is not answering. False where that cannot be read."""
    try:
        return acks_fresh(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104), within_s)
    except (OSError, AttributeError, struct.error):
        return False


class RankControl(LeaderResume):
    """The process-wide control connection of global rank `rank`.

    Raises (constructor):
        ValueError: the coordinator refused the hello (e.g. the slot is already active).
        TimeoutError: no answer within timeout_s.
    """

    def __init__(self, address: str, rank: int, world_size: int, max_world_size: int,
                 is_extension: bool, timeout_s: float,
                 stall_grace_s: float = STALL_GRACE_S,
                 membership_store: str | None = None) -> None:
        self.address, self.rank, self.timeout_s = address, rank, timeout_s
        self.stall_grace_s = stall_grace_s
        self.world_size, self.max_world_size = world_size, max_world_size
        # etcd://... : a lost coordinator is a leader change (see the module docstring)
        self.membership_store = membership_store or None
        self.resuming = False
        self.on_resumed: list[Callable[[], None]] = []  # after a resume, reader thread
        self.conn: Connection = connect(address, timeout_s)
        # the address the kernel routes towards the coordinator: what peers on other
        # hosts can reach (the inner Gloo groups bind it; see gloo_device)
        self.local_addr: str = self.conn.sock.getsockname()[0]
        self.groups: dict[str, Any] = {}
        self._early: dict[str, list[m.GroupPush]] = {}
        self._detached: set[str] = set()  # groups this process destroyed: pushes dropped
        self.evicted: str | None = None
        self.lost = False
        self.lost_reason = "control connection to the coordinator closed"
        self.last_ack = time.monotonic()
        self._ids = itertools.count(1)
        # request id -> (its event, its answer box, the request: sent again after a resume)
        self._replies: dict[int, tuple[threading.Event, list, m.ControlMessage]] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"elastic-ctl-r{rank}")
        self._reader.start()
        try:
            hello = self.request(m.RankHello(rank, os.getpid(), world_size, max_world_size,
                                             is_extension))
        except BaseException:
            self.conn.close()  # ends the reader thread too
            raise
        self._take_hello(hello)
        if self.membership_store:
            # listed in etcd while this process lives, so that a leader taking over
            # fails at once a rank that died with the old one (membership/takeover.py)
            from elasticep.membership.directory import announce_rank  # etcd only if asked
            from elasticep.membership.election import lease_ttl_s

            announce_rank(self.membership_store, rank, lease_ttl_s(self.hb_timeout_s),
                          self.conn.sock.getsockname()[0])
        threading.Thread(target=self._hb_loop, daemon=True, name=f"elastic-hb-r{rank}").start()

    # ------------------------------------------------------------------ requests
    def request(self, msg: m.ControlMessage, timeout_s: float | None = None) -> m.Reply:
        """Send a request and wait for its reply (read its fields as ``reply["name"]``).

        Raises:
            ValueError: the coordinator answered ok=False (its reason is the message).
            TimeoutError: no reply within timeout_s.
            CoordinatorLostError: the connection broke.
        """
        rid = next(self._ids)
        ev, box = threading.Event(), []
        msg = replace(msg, id=rid)
        with self._lock:  # a resume swaps the connection under it: sent once on either
            lost, sent = self.lost, False  # (lost is set before the waiters are cleared)
            if not lost:
                self._replies[rid] = (ev, box, msg)
                sent = self.conn.send(msg)
        if lost or not (sent or self.membership_store):  # else: sent again on resume
            with self._lock:
                self._replies.pop(rid, None)
            raise CoordinatorLostError(f"rank {self.rank}: coordinator connection is closed")
        if not ev.wait(timeout_s or self.timeout_s):
            with self._lock:
                self._replies.pop(rid, None)
            raise TimeoutError(f"rank {self.rank}: no reply to {msg.TAG!r} from coordinator")
        reply = box[0]
        if reply is None:
            if self.evicted:
                raise RankEvictedError(f"rank {self.rank} evicted: {self.evicted}")
            raise CoordinatorLostError(f"rank {self.rank}: {self.lost_reason}")
        if not reply.ok:
            raise ValueError(reply.error or "refused by coordinator")
        return reply

    def attach(self, name: str, gs, epoch: int) -> None:
        """Route pushes for group `name` to `gs`, replaying those that arrived between the
        registration reply (which reflected `epoch`) and now."""
        with self._lock:
            early = self._early.pop(name, [])
            self.groups[name] = gs
        for msg in early:
            if isinstance(msg, m.Peer) or msg.epoch > epoch:
                gs.on_push(msg)

    def detach(self, name: str) -> None:
        """Stop routing pushes for group `name` (this process destroyed it)."""
        with self._lock:
            self.groups.pop(name, None)
            self._early.pop(name, None)
            self._detached.add(name)

    def send(self, msg: m.ControlMessage) -> None:
        """Send a message that expects no reply (a report)."""
        self.conn.send(msg)

    def lease_fresh(self) -> bool:
        """True if a heartbeat ack arrived within 3 intervals (cheap, no I/O)."""
        return time.monotonic() - self.last_ack < 3 * self.hb_interval_s + 0.05

    def confirm_membership(self) -> None:
        """Round-trip to the coordinator; raises RankEvictedError if we were evicted.

        While the coordinator's host still acknowledges (a stalled coordinator process,
        see the module docstring) the ping is retried for up to :attr:`stall_grace_s`.
        """
        if self.evicted:
            raise RankEvictedError(f"rank {self.rank} evicted: {self.evicted}")
        start = time.monotonic()
        while True:
            try:
                self.request(m.Ping(), timeout_s=min(self.timeout_s, 5.0))
                break
            except TimeoutError as e:
                if (time.monotonic() - start < self.stall_grace_s and not self.evicted
                        and (self.resuming or peer_host_acks(self.conn.sock, 5.0))):
                    continue
                raise RankEvictedError(f"rank {self.rank} cannot confirm membership: {e}") from e
            except CoordinatorLostError as e:
                raise RankEvictedError(f"rank {self.rank} cannot confirm membership: {e}") from e
        if self.evicted:
            raise RankEvictedError(f"rank {self.rank} evicted: {self.evicted}")

    # ------------------------------------------------------------------ threads
    def _silence_limit_s(self) -> float:
        """The coordinator's eviction limit for this rank: the heartbeat timeout while
        it is an active member of a group, the (longer) joiner's limit before that."""
        with self._lock:
            groups = list(self.groups.values())
        member = any(gs.joined and gs.slot in gs.active for gs in groups)
        return self.hb_timeout_s if member else self.join_hb_timeout_s

    def _hb_loop(self) -> None:
        tick = time.monotonic()
        waiting = False  # on a stalled coordinator (logged once per stall)
        while not self.lost:
            if self.resuming:  # the reader thread is finding the new leader
                time.sleep(self.hb_interval_s)
                tick = time.monotonic()
                continue
            self.conn.send(m.Heartbeat())  # a send that fails shows up as silence below
            now = time.monotonic()
            if now - tick > 2 * self.hb_interval_s:
                # this thread overslept: the process was frozen (or starved), and its
                # reader thread has yet to read what arrived meanwhile (an eviction
                # notice, acks): give it that moment before judging the silence
                time.sleep(min(self.hb_interval_s, 0.1))
            silent_s = time.monotonic() - self.last_ack
            limit_s = self._silence_limit_s()
            stalled = (limit_s < silent_s < self.stall_grace_s
                       and peer_host_acks(self.conn.sock, limit_s))
            if stalled and not waiting:
                log.warning("rank %d: coordinator silent for %.1f s, but its host acknowledges:"
                            " waiting for it (up to %g s; no step commits meanwhile)",
                            self.rank, silent_s, self.stall_grace_s)
            waiting = stalled
            if silent_s > limit_s and not stalled and not (self.lost or self.evicted):
                self.lost_reason = (f"coordinator at {self.address} unreachable: no answer "
                                    f"for {silent_s:.1f} s (heartbeat timeout {limit_s:g} s)")
                if self.membership_store:  # the reader sees EOF and finds the new leader
                    log.warning("rank %d: %s; looking for the leader", self.rank,
                                self.lost_reason)
                    self.resuming, self.last_ack = True, time.monotonic()
                    self.conn.close()
                    continue
                log.error("rank %d: %s; stopping", self.rank, self.lost_reason)
                self.conn.close()  # the reader sees EOF: every waiter wakes up lost
                return
            tick = time.monotonic()
            time.sleep(self.hb_interval_s)

    def _read_loop(self) -> None:
        while True:
            self._read_until_closed()
            if not self._resume():
                break
        self.lost = True
        with self._lock:
            waiters, self._replies = list(self._replies.values()), {}
        for ev, box, _msg in waiters:
            box.append(None)
            ev.set()
        for gs in list(self.groups.values()):
            gs.on_lost()

    def _read_until_closed(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except m.ProtocolError as e:
                log.warning("rank %d: dropped a control message: %s", self.rank, e)
                if e.rid is not None:  # a broken reply: its request fails now, not later
                    self._answer(m.Reply(id=e.rid, ok=False, error=f"bad reply: {e}"))
                continue
            if msg is None:
                break
            if isinstance(msg, m.HeartbeatAck):
                self.last_ack = time.monotonic()
            elif isinstance(msg, m.Reply):
                self.last_ack = time.monotonic()
                self._answer(msg)
            elif isinstance(msg, m.Evicted):
                self.evicted = msg.reason
                log.warning("rank %d: evicted by coordinator (%s)", self.rank, self.evicted)
            elif isinstance(msg, m.GroupPush):
                self._to_group(msg)
            else:
                log.warning("rank %d: dropped a %r message (not for a rank)", self.rank,
                            msg.TAG)

    # ------------------------------------------------------------------ hello
    def _take_hello(self, hello: m.Reply) -> None:
        self.store_port: int = int(hello["store_port"])
        self.hb_interval_s: float = float(hello["hb_interval_s"])
        self.hb_timeout_s: float = float(hello["hb_timeout_s"])
        self.join_hb_timeout_s: float = float(hello["join_hb_timeout_s"])

    def _answer(self, reply: m.Reply) -> None:
        with self._lock:
            waiter = self._replies.pop(reply.id, None)
        if waiter is not None:
            waiter[1].append(reply)
            waiter[0].set()

    def _to_group(self, msg: m.GroupPush) -> None:
        with self._lock:
            gs = self.groups.get(msg.group)
            if gs is None and msg.group not in self._detached:
                # registered but not attached yet: keep for `attach`
                self._early.setdefault(msg.group, []).append(msg)
        if gs is not None:
            try:
                gs.on_push(msg)
            except Exception:  # keep the control plane alive whatever happens
                log.exception("rank %d: error handling %s", self.rank, msg.TAG)
