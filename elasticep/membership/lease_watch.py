"""Seeing an etcd lease run out when it does, not when etcd next sweeps it.

etcd deletes an expired lease's keys only at its leader's next expiry sweep, which runs
every half second (etcd's lessor loop): a key outlives its lease by up to 0.5 s. For a
host that died with the leader coordinator, that is 0.5 s more for the new leader to
wait on the old leader's key, and another 0.5 s on the dead ranks' keys, all in the
serving gap (docs/design/ha_membership.md, "Seeing a lease run out").

etcd's ``LeaseTimeToLive`` answers the remaining TTL in whole seconds, truncated (its
API: the lease "will expire in under TTL+1 seconds"). So a reading of 0 says the lease
has less than a second left, and the first 0 after a reading of 1 or more marks, to
within the poll period, the moment one second before expiry. A lease that then reads
0 for a full second more, with no reading of 1 or more between (a keep-alive would
bring one within a second, when the granted TTL is 2 s or more), has expired on etcd's
own clock: etcd refuses it any further keep-alive, so revoking it, or acting as if its
keys were gone, anticipates etcd's sweep and nothing else. A lease kept alive never
reads 0 (its owner renews every TTL / 3), whatever the poll finds, so a live owner
that is merely slow is never taken for dead before etcd itself would.

The first half of the rule needs readings from before the lease reads 0, which is
before the leader's own lease runs out: a coordinator replica watches, from its start,
the rank keys of the host its leader runs on (:class:`LiveRanks`), so that once it
takes over it knows which of them ran out with the old leader.

    watch = ExpiryWatch()
    watch.observe(sent, received, ttl=1, granted=2)   # False
    ...
    watch.observe(sent, received, ttl=0, granted=2)   # True once expired (see above)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import MembershipStoreError

if TYPE_CHECKING:  # etcd's client is imported only where etcd is asked for
    from .etcd_store import EtcdKV, EtcdMembershipStore

log = logging.getLogger("elasticep.membership")

POLL_S = 0.1  # how often a watched lease is read: the precision of its expiry, seconds
LIST_S = 1.0  # how often a replica that does not lead lists the rank keys, seconds

# a lease granted for less cannot show a keep-alive in its readings (a fresh one already
# reads 0), so it is left to etcd's sweep
MIN_GRANTED_S = 2


@dataclass
class ExpiryWatch:
    """The readings of one lease's remaining TTL, and whether it has run out.

    Attributes:
        zero_since: when (``received``, monotonic seconds) the current run of 0 readings
            began; None: the last reading was 1 or more (or none yet).
        last_sent: when the last reading was asked for (monotonic seconds).
    """

    zero_since: float | None = None
    last_sent: float | None = None

    def observe(self, sent: float, received: float, ttl: int, granted: int) -> bool:
        """Take one reading and say whether the lease has expired.

        Args:
            sent, received: when the request left and its answer came (this process's
                monotonic clock, seconds).
            ttl: the remaining TTL etcd answered, whole seconds, truncated (-1: etcd
                no longer knows the lease).
            granted: the TTL the lease was granted, seconds.
        Returns:
            True when etcd no longer knows the lease, or when it read 0 for at least a
            second with readings less than ``granted - 1`` seconds apart (a keep-alive
            in between would have shown as a reading of 1 or more).
        """
        previous, self.last_sent = self.last_sent, sent
        if ttl < 0:
            return True
        if ttl >= 1 or granted < MIN_GRANTED_S:
            self.zero_since = None
            return False
        if (self.zero_since is None or previous is None
                or received - previous >= granted - 1):
            self.zero_since = received  # a keep-alive could hide in a longer gap
            return False
        return sent >= self.zero_since + 1.0


def time_to_live(kv: EtcdKV, lease: int) -> tuple[int, int]:
    """``(remaining TTL, granted TTL)`` of ``lease``, whole seconds; ``(-1, 0)`` when etcd
    no longer knows it. (etcd's JSON gateway leaves a zero field out.)

    Raises:
        StoreUnavailableError: no etcd member answered.
    """
    out = kv.post("lease/timetolive", {"ID": lease})
    return int(out.get("TTL", 0)), int(out.get("grantedTTL", 0))


class LeaseWatch:
    """:class:`ExpiryWatch` for several leases at once, polled through ``kv``.

    Args:
        kv: the etcd client.
        clock: monotonic seconds.
    """

    def __init__(self, kv: EtcdKV, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv, self._clock = kv, clock
        self._watches: dict[int, ExpiryWatch] = {}

    def expired(self, leases: Iterable[int]) -> set[int]:
        """Read each lease of ``leases`` once; return those that have run out. Leases
        no longer asked about are forgotten.

        Raises:
            StoreUnavailableError: no etcd member answered (the readings so far are
                kept; a later call starts the interrupted runs of zeros again).
        """
        wanted = set(leases)
        self._watches = {k: w for k, w in self._watches.items() if k in wanted}
        gone = set()
        for lease in sorted(wanted):
            w = self._watches.setdefault(lease, ExpiryWatch())
            sent = self._clock()
            ttl, granted = time_to_live(self.kv, lease)
            if w.observe(sent, self._clock(), ttl, granted):
                gone.add(lease)
        return gone


def _host(address: str) -> str:
    return address.rpartition(":")[0]


class LiveRanks:
    """Global rank -> pid of the rank processes etcd lists whose lease has not run out:
    what a new leader checks its placeholders against (``takeover.py``).

    From :meth:`start` until :meth:`close`, a thread lists the rank keys (each
    :data:`LIST_S`, and at each call) and reads, each :data:`POLL_S`, the lease of each
    rank key announced from the host of the latest leader other than this replica, the
    ranks that die with that leader if its host does. A leader's own replica watches
    none until another one leads.

    Args:
        store: the deployment's etcd store (a client of its own: other threads use theirs).
        own: this replica's id (its control address, ``HOST:PORT``).
        clock: monotonic seconds.
    """

    def __init__(self, store: EtcdMembershipStore, own: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.own, self._clock = store, own, clock
        self._watch = LeaseWatch(store.kv, clock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._entries: dict[int, tuple[int, int, str | None]] = {}
        self._expired: set[int] = set()
        self._host: str | None = None  # the host of the latest other leader
        self._listed_at = float("-inf")

    def start(self) -> LiveRanks:
        threading.Thread(target=self._run, daemon=True, name="coord-live-ranks").start()
        return self

    def close(self) -> None:
        """Stop the thread (no further reads of etcd)."""
        self._stop.set()

    def __call__(self) -> dict[int, int]:
        """List the rank keys and read the watched leases now; rank -> pid of those
        listed whose lease has not run out.

        Raises:
            StoreUnavailableError: no etcd member answered.
        """
        with self._lock:
            self._poll(list_now=True)
            return {r: pid for r, (pid, lease, _h) in self._entries.items()
                    if lease not in self._expired}

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                with self._lock:
                    self._poll(list_now=self._clock() - self._listed_at >= LIST_S)
            except MembershipStoreError as e:  # nothing known this time; next poll
                log.debug("coordinator: rank leases: %s", e)

    def _poll(self, list_now: bool) -> None:
        from .directory import rank_entries

        if list_now:
            self._listed_at = self._clock()
            leader, _, _ = self.store.kv.get(self.store.key("leader"))
            if leader is not None and leader.decode() != self.own:
                self._host = _host(leader.decode())
            self._entries = rank_entries(self.store)
        watched = ({lease for _pid, lease, host in self._entries.values()
                    if lease and host in (None, self._host)} if self._host is not None
                   else set())
        gone = self._watch.expired(watched)
        for r, (pid, lease, _h) in self._entries.items():
            if lease in gone and lease not in self._expired:
                log.info("coordinator: rank %d (pid %d): its lease ran out", r, pid)
        self._expired = gone
