"""Leader election among coordinator replicas with an etcd lease.

Each replica campaigns by creating the ``leader`` key with a lease of ``ttl_s``; the one
whose create succeeds leads, and keeps the lease alive every ``ttl_s / 3``. If it dies
(or is cut off from the etcd majority) its lease expires after ``ttl_s`` and etcd
deletes the key, so a standby's next try succeeds. A standby watches the leader's lease
(``lease_watch.py``) and revokes it as soon as it has run out on etcd's clock, instead
of waiting up to half a second more for etcd's sweep to delete the key.

A leader also stops counting itself as one on its own clock: once ``ttl_s`` has passed
since its last keep-alive that etcd answered, :attr:`LeaderLease.is_leader` is False,
even before it hears of a successor (the lease may have expired). Together with the
fenced commits of ``store.py`` this gives one leader at a time.

    lease = LeaderLease(store, "node1", ttl_s=2)
    lease.campaign(timeout_s=30)       # blocks until this replica leads
    lease.is_leader, lease.leader()    # True, "node1"
    lease.resign()
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import MembershipStoreError, StoreUnavailableError
from .lease_watch import ExpiryWatch, time_to_live

if TYPE_CHECKING:  # etcd's client is imported only where etcd is asked for
    from .etcd_store import EtcdMembershipStore

log = logging.getLogger("elasticep.membership")

POLL_S = 0.1  # a standby's retry period: failover costs at most this beyond the TTL
STANDBY_CHECK_S = 0.5  # how often a campaigning standby checks it should still run


def lease_ttl_s(heartbeat_timeout_s: float) -> int:
    """The leader lease TTL for a ``--heartbeat-timeout``: whole seconds (etcd's unit),
    at least 1, so a dead leader is replaced about as fast as a dead rank is evicted."""
    return max(1, math.ceil(heartbeat_timeout_s))


class LeaderLease:
    """One replica's candidacy; see the module docstring.

    Args:
        store: the deployment's etcd store (its ``leader`` key is used).
        candidate: this replica's id (its control address, say), written as the value.
        ttl_s: lease TTL in whole seconds (``lease_ttl_s``).
        on_lost: called once, on the keep-alive thread, if leadership is lost.
        recampaign: after a loss, campaign again on that thread until elected or
            :meth:`resign` (a replica that lost its lease only to an etcd outage takes
            it back when etcd does; one that lost it to a successor stays a standby,
            and its commits are fenced).
        on_deposed: called once, on that thread, with the successor's id if the
            campaign after a loss finds another replica leading: the owner steps down
            (a coordinator closes its connections, so its ranks move to the leader
            instead of serving on with a deposed one). The campaign then stops.
        clock: monotonic seconds.
    """

    def __init__(self, store: EtcdMembershipStore, candidate: str, ttl_s: int,
                 on_lost: Callable[[], None] | None = None, recampaign: bool = False,
                 on_deposed: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.candidate = candidate
        self.ttl_s = ttl_s
        self._on_lost = on_lost
        self._recampaign = recampaign
        self._on_deposed = on_deposed
        self._clock = clock
        self._lease: int | None = None
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._key = store.key("leader")
        self._holder_watch: tuple[int, ExpiryWatch] | None = None  # (lease, its readings)

    @property
    def is_leader(self) -> bool:
        """This replica holds the lease and its TTL has not run out on its own clock."""
        return self._lease is not None and self._clock() < self._valid_until

    def leader(self) -> str | None:
        """The current leader's id, or None while there is none.

        Raises:
            StoreUnavailableError: etcd did not answer.
        """
        value, _, _ = self.store.kv.get(self._key)
        return None if value is None else value.decode()

    def try_acquire(self) -> bool:
        """One attempt: True if this replica now leads (and the keep-alive runs).

        Raises:
            StoreUnavailableError: etcd did not answer.
        """
        if self.is_leader:
            return True
        started = self._clock()
        lease = int(self.store.kv.post("lease/grant", {"TTL": self.ttl_s, "ID": 0})["ID"])
        ok, _ = self.store.txn_create(self._key, self.candidate, lease)
        if not ok:
            self._revoke(lease)
            return False
        self._lease = lease
        self._valid_until = started + self.ttl_s
        self._stop.clear()
        threading.Thread(target=self._keep_alive, args=(lease,), daemon=True,
                         name="coord-leader-lease").start()
        log.info("coordinator %s: elected leader (lease %x, ttl %d s)", self.candidate,
                 lease, self.ttl_s)
        return True

    def campaign(self, timeout_s: float) -> None:
        """Block until this replica leads, retrying every ``POLL_S``.

        Raises:
            TimeoutError: not elected within ``timeout_s`` seconds.
        """
        deadline = self._clock() + timeout_s
        while True:
            try:
                if self._attempt()[0]:
                    return
            except StoreUnavailableError as e:
                log.warning("coordinator %s: cannot campaign: %s", self.candidate, e)
            if self._clock() >= deadline:
                raise TimeoutError(f"{self.candidate} not elected within {timeout_s:.1f} s "
                                   f"(leader: {self._leader_or_unknown()})")
            time.sleep(POLL_S)

    def resign(self) -> None:
        """Stop leading now (the key goes with the lease, so a standby takes over at its
        next try instead of after the TTL)."""
        lease, self._lease = self._lease, None
        self._stop.set()
        if lease is not None:
            self._revoke(lease)

    def _attempt(self) -> tuple[bool, str | None]:
        """One campaign step: lead if no replica does, or if the leader's lease has run
        out on etcd's clock (it is revoked first: etcd refuses it any keep-alive, so
        this only spares the wait for etcd's sweep). Returns (this replica leads now,
        the id the ``leader`` key names otherwise: another replica's, or this one's
        while its own expired lease still holds the key; None if none).

        Raises:
            StoreUnavailableError: etcd did not answer.
        """
        from .etcd_store import b64, unb64

        if self.is_leader:
            return True, None
        kvs = self.store.kv.post("kv/range", {"key": b64(self._key)}).get("kvs") or []
        if kvs:
            holder, lease = unb64(kvs[0].get("value", "")).decode(), int(kvs[0].get("lease", 0))
            if not lease or not self._ran_out(lease):
                return False, holder
            log.info("coordinator %s: the lease of leader %s ran out; revoking it",
                     self.candidate, holder)
            self._revoke(lease)
        self._holder_watch = None
        if self.try_acquire():
            return True, None
        return False, self.leader()  # another replica was quicker

    def _ran_out(self, lease: int) -> bool:
        """One reading of the leader's ``lease``: has it expired (``lease_watch.py``)?"""
        if self._holder_watch is None or self._holder_watch[0] != lease:
            self._holder_watch = (lease, ExpiryWatch())
        sent = self._clock()
        ttl, granted = time_to_live(self.store.kv, lease)
        return self._holder_watch[1].observe(sent, self._clock(), ttl, granted)

    def _leader_or_unknown(self) -> str:
        try:
            return str(self.leader())
        except StoreUnavailableError:
            return "unknown (etcd unreachable)"

    def _revoke(self, lease: int) -> None:
        try:
            self.store.kv.post("kv/lease/revoke", {"ID": lease})
        except MembershipStoreError:
            pass  # unreachable: it expires on its own after the TTL; unknown: it did

    def _keep_alive(self, lease: int) -> None:
        period = self.ttl_s / 3
        while not self._stop.wait(period):
            sent = self._clock()
            try:
                out = self.store.kv.post("lease/keepalive", {"ID": lease})
                ttl = int(out.get("result", {}).get("TTL", -1))
            except StoreUnavailableError as e:
                log.warning("coordinator %s: lease keep-alive failed: %s", self.candidate, e)
                ttl = 0 if self._clock() >= self._valid_until else None
            except MembershipStoreError as e:  # etcd answered: the lease is not there
                log.warning("coordinator %s: lease keep-alive refused: %s", self.candidate, e)
                ttl = 0
            if ttl is None:
                continue  # retry; still within the TTL
            if ttl <= 0:
                break
            self._valid_until = sent + self.ttl_s
        if self._lease != lease or self._stop.is_set():
            return
        self._lease = None
        log.warning("coordinator %s: lost the leader lease", self.candidate)
        if self._on_lost is not None:
            self._on_lost()
        while self._recampaign and not self._stop.wait(POLL_S):
            try:
                # our own key may outlive our clock: not deposed
                led, holder = self._attempt()
                if led:  # its own keep-alive thread takes over
                    return
            except MembershipStoreError as e:  # etcd still away: keep trying
                log.debug("coordinator %s: campaign: %s", self.candidate, e)
                continue
            if holder not in (None, self.candidate) and self._on_deposed is not None:
                log.error("coordinator %s: %s leads now; stepping down", self.candidate,
                          holder)
                self._on_deposed(holder)
                return


def campaign_for(url: str, deployment_id: str, hb_timeout_s: float, address: str,
                 standby_until: Callable[[], bool] | None = None,
                 on_deposed: Callable[[str], None] | None = None):
    """Open the etcd store of ``url`` and win the leader lease as ``address`` (a
    coordinator's control endpoint): what a coordinator process does before it serves.
    Returns ``(store, lease)``, or ``(store, None)`` if ``standby_until`` said stop
    first. The store's commits need the lease (``store.leader_id``).

    The first replica (``standby_until`` None, node 0's at start) claims the prefix for
    ``deployment_id`` and must win within the TTL and a margin (a lease still held is a
    crashed predecessor's). A standby claims nothing (the prefix is its deployment's)
    and campaigns until elected or ``standby_until()`` is true. ``on_deposed``: see
    :class:`LeaderLease`.

    Raises:
        MembershipStoreError: etcd unreachable, or the prefix held by another deployment.
        TimeoutError: the first replica was not elected in time.
    """
    from .directory import REPLICAS, Announcement
    from .etcd_store import EtcdMembershipStore, open_etcd_store  # etcd only if asked
    from .store import parse_store_url

    spec = parse_store_url(url)
    store = (open_etcd_store(spec, deployment_id) if standby_until is None
             else EtcdMembershipStore(spec))
    store.leader_id = address
    ttl = lease_ttl_s(hb_timeout_s)
    # listed while this process lives, standby or leader (/elastic_ep_status shows them)
    Announcement(store, REPLICAS, address, {"address": address, "pid": os.getpid()},
                 ttl).start(required=False)
    lease = LeaderLease(store, address, ttl, recampaign=True, on_deposed=on_deposed,
                        on_lost=lambda: log.error(
                            "coordinator: lost the leader lease; campaigning again (a "
                            "successor's commits would fence this one's)"))
    if standby_until is None:
        lease.campaign(timeout_s=ttl + 5)
        return store, lease
    while not standby_until():
        try:
            lease.campaign(timeout_s=STANDBY_CHECK_S)
            return store, lease
        except TimeoutError:
            continue
    return store, None


def find_leader(store: EtcdMembershipStore, timeout_s: float) -> str:
    """The id of the elected coordinator (its control address, ``HOST:PORT``), waiting
    up to ``timeout_s`` seconds for one to be elected: how `join` finds the coordinator
    from ``--membership-store`` alone.

    Raises:
        StoreUnavailableError: etcd did not answer.
        TimeoutError: no leader within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    key = store.key("leader")
    while True:
        value, _, _ = store.kv.get(key)
        if value is not None:
            return value.decode()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no coordinator leads under {store.root} (waited "
                               f"{timeout_s:g} s): is serve running with this "
                               "--membership-store?")
        time.sleep(POLL_S)
