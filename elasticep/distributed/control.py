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
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any

from .errors import CoordinatorLostError, RankEvictedError
from .protocol import Connection, connect

log = logging.getLogger(__name__)


class RankControl:
    """The process-wide control connection of global rank `rank`.

    Raises (constructor):
        ValueError: the coordinator refused the hello (e.g. the slot is already active).
        TimeoutError: no answer within timeout_s.
    """

    def __init__(self, address: str, rank: int, world_size: int, max_world_size: int,
                 is_extension: bool, timeout_s: float) -> None:
        self.address, self.rank, self.timeout_s = address, rank, timeout_s
        self.conn: Connection = connect(address, timeout_s)
        # the address the kernel routes towards the coordinator: what peers on other
        # hosts can reach (the inner Gloo groups bind it; see gloo_device)
        self.local_addr: str = self.conn.sock.getsockname()[0]
        self.groups: dict[str, Any] = {}
        self._early: dict[str, list[dict]] = {}
        self._detached: set[str] = set()  # groups this process destroyed: pushes dropped
        self.evicted: str | None = None
        self.lost = False
        self.lost_reason = "control connection to the coordinator closed"
        self.last_ack = time.monotonic()
        self._ids = itertools.count(1)
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"elastic-ctl-r{rank}")
        self._reader.start()
        hello = self.request({"t": "hello", "rank": rank, "pid": os.getpid(),
                              "world_size": world_size, "max_world_size": max_world_size,
                              "is_extension": is_extension})
        self.store_port: int = hello["store_port"]
        self.hb_interval_s: float = hello["hb_interval_s"]
        self.hb_timeout_s: float = hello["hb_timeout_s"]
        self.join_hb_timeout_s: float = hello["join_hb_timeout_s"]
        threading.Thread(target=self._hb_loop, daemon=True, name=f"elastic-hb-r{rank}").start()

    # ------------------------------------------------------------------ requests
    def request(self, msg: dict, timeout_s: float | None = None) -> dict:
        """Send a request and wait for its reply.

        Raises:
            ValueError: the coordinator answered ok=False (its reason is the message).
            TimeoutError: no reply within timeout_s.
            CoordinatorLostError: the connection broke.
        """
        rid = next(self._ids)
        ev, box = threading.Event(), []
        with self._lock:
            self._replies[rid] = (ev, box)
        if not self.conn.send({**msg, "id": rid}):
            raise CoordinatorLostError(f"rank {self.rank}: coordinator connection is closed")
        if not ev.wait(timeout_s or self.timeout_s):
            with self._lock:
                self._replies.pop(rid, None)
            raise TimeoutError(f"rank {self.rank}: no reply to {msg['t']!r} from coordinator")
        reply = box[0]
        if reply is None:
            if self.evicted:
                raise RankEvictedError(f"rank {self.rank} evicted: {self.evicted}")
            raise CoordinatorLostError(f"rank {self.rank}: {self.lost_reason}")
        if not reply.get("ok"):
            raise ValueError(reply.get("error", "refused by coordinator"))
        return reply

    def attach(self, name: str, gs, epoch: int) -> None:
        """Route pushes for group `name` to `gs`, replaying those that arrived between the
        registration reply (which reflected `epoch`) and now."""
        with self._lock:
            early = self._early.pop(name, [])
            self.groups[name] = gs
        for msg in early:
            e = msg.get("epoch", msg.get("decision", {}).get("epoch", epoch + 1))
            if msg["t"] == "peer" or e > epoch:
                gs.on_push(msg)

    def detach(self, name: str) -> None:
        """Stop routing pushes for group `name` (this process destroyed it)."""
        with self._lock:
            self.groups.pop(name, None)
            self._early.pop(name, None)
            self._detached.add(name)

    def send(self, msg: dict) -> None:
        self.conn.send(msg)

    def lease_fresh(self) -> bool:
        """True if a heartbeat ack arrived within 3 intervals (cheap, no I/O)."""
        return time.monotonic() - self.last_ack < 3 * self.hb_interval_s + 0.05

    def confirm_membership(self) -> None:
        """Round-trip to the coordinator; raises RankEvictedError if we were evicted."""
        if self.evicted:
            raise RankEvictedError(f"rank {self.rank} evicted: {self.evicted}")
        try:
            self.request({"t": "ping"}, timeout_s=min(self.timeout_s, 5.0))
        except (CoordinatorLostError, TimeoutError) as e:
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
        while not self.lost:
            self.conn.send({"t": "hb"})  # a send that fails shows up as silence below
            now = time.monotonic()
            if now - tick > 2 * self.hb_interval_s:
                # this thread overslept: the process was frozen (or starved), and its
                # reader thread has yet to read what arrived meanwhile (an eviction
                # notice, acks): give it that moment before judging the silence
                time.sleep(min(self.hb_interval_s, 0.1))
            silent_s = time.monotonic() - self.last_ack
            limit_s = self._silence_limit_s()
            if silent_s > limit_s and not (self.lost or self.evicted):
                self.lost_reason = (f"coordinator at {self.address} unreachable: no answer "
                                    f"for {silent_s:.1f} s (heartbeat timeout {limit_s:g} s)")
                log.error("rank %d: %s; stopping", self.rank, self.lost_reason)
                self.conn.close()  # the reader sees EOF: every waiter wakes up lost
                return
            tick = time.monotonic()
            time.sleep(self.hb_interval_s)

    def _read_loop(self) -> None:
        while True:
            msg = self.conn.recv()
            if msg is None:
                break
            t = msg["t"]
            if t == "hb_ack":
                self.last_ack = time.monotonic()
            elif t == "reply":
                self.last_ack = time.monotonic()
                with self._lock:
                    waiter = self._replies.pop(msg.get("id"), None)
                if waiter is not None:
                    waiter[1].append(msg)
                    waiter[0].set()
            elif t == "evicted":
                self.evicted = msg.get("reason", "evicted")
                log.warning("rank %d: evicted by coordinator (%s)", self.rank, self.evicted)
            else:
                with self._lock:
                    gs = self.groups.get(msg.get("group"))
                    if gs is None and msg.get("group") not in self._detached:
                        # registered but not attached yet: keep for `attach`
                        self._early.setdefault(msg.get("group"), []).append(msg)
                if gs is not None:
                    try:
                        gs.on_push(msg)
                    except Exception:  # keep the control plane alive whatever happens
                        log.exception("rank %d: error handling %s", self.rank, t)
        self.lost = True
        with self._lock:
            waiters, self._replies = list(self._replies.values()), {}
        for ev, box in waiters:
            box.append(None)
            ev.set()
        for gs in list(self.groups.values()):
            gs.on_lost()
