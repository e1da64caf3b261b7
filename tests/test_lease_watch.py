"""Seeing an etcd lease run out before etcd's sweep deletes its keys
(``membership/lease_watch.py``), on a clock of the test's: the rule on readings of the
remaining TTL, and a replica's watch of the rank keys of its leader's host. The same
against a real etcd: tests/test_etcd_membership.py (the leader's lease)."""

import json

from elasticep.membership.directory import RANKS
from elasticep.membership.etcd_store import EtcdMembershipStore, b64, unb64
from elasticep.membership.lease_watch import ExpiryWatch, LiveRanks
from elasticep.membership.store import parse_store_url


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _readings(watch: ExpiryWatch, clock: Clock, remaining, until: float, step: float = 0.1,
              granted: int = 2) -> float | None:
    """Read ``remaining(t)`` (seconds, etcd's truncation) every ``step`` until ``until``;
    the time the watch first says expired, or None."""
    while clock.now < until:
        r = remaining(clock.now)
        ttl = -1 if r is None else int(r)
        if watch.observe(clock.now, clock.now + 0.005, ttl, granted):
            return clock.now
        clock.now = round(clock.now + step, 6)
    return None


def test_a_lease_is_expired_one_second_after_its_first_zero_and_not_before():
    clock = Clock()
    # kept alive every TTL/3 for 5 s: never expired
    assert _readings(ExpiryWatch(), clock, lambda t: 2 - (t % 0.667), until=5.0) is None
    # last keep-alive at 5.0: reads 0 after 6.0, expired at 7.0; said within two
    # readings (the first zero, at 6.1, starts a second that ends past 7.1)
    at = _readings(ExpiryWatch(), clock, lambda t: 7.0 - t, until=9.0)
    assert at is not None and 7.0 <= at <= 7.21
    # a late keep-alive (0.6 s into the zeros) is seen, and the run starts again
    clock.now = 0.0
    at = _readings(ExpiryWatch(), clock, lambda t: (2.0 - t) if t < 1.6 else (3.6 - t),
                   until=5.0)
    assert at is not None and 3.6 <= at <= 3.81
    # etcd no longer knows the lease: gone at once
    assert ExpiryWatch().observe(0.0, 0.0, -1, 2)


def test_a_gap_in_the_readings_or_a_one_second_lease_proves_nothing():
    w = ExpiryWatch()
    assert not w.observe(0.0, 0.0, 0, 2)
    # a second later, but a keep-alive could have come and gone in the gap
    assert not w.observe(1.2, 1.2, 0, 2)
    assert not w.observe(1.7, 1.7, 0, 2)
    assert w.observe(2.2, 2.2, 0, 2)  # a second of zeros less than 1 s apart: expired
    w = ExpiryWatch()
    # granted 1 s: it reads 0 even while kept alive, so a run of zeros says nothing
    assert not any(w.observe(t / 10, t / 10, 0, 1) for t in range(40))


class FakeEtcd:
    """The few answers of etcd that the watch reads, on the test's clock: keys (with
    the lease they are under) and leases (their expiry; the remaining TTL is truncated
    to whole seconds as etcd does). Nothing is swept: a key outlives its lease."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.keys: dict[str, tuple[bytes, int]] = {}
        self.expiry: dict[int, float] = {}
        self.reads: list[int] = []

    def put(self, key: str, value: bytes, lease: int) -> None:
        self.keys[key] = (value, lease)
        self.expiry[lease] = self.clock() + 2

    def keep_alive(self, lease: int) -> None:
        self.expiry[lease] = self.clock() + 2

    def get(self, key: str):
        value, _lease = self.keys.get(key, (None, 0))
        return value, 1, 1

    def post(self, path: str, body: dict):
        if path == "lease/timetolive":
            lease = int(body["ID"])
            self.reads.append(lease)
            left = self.expiry[lease] - self.clock()
            return {"TTL": str(int(left)), "grantedTTL": "2"}
        assert path == "kv/range", path
        prefix = unb64(body["key"]).decode()
        return {"kvs": [{"key": b64(k), "value": b64(v), "lease": str(lease)}
                        for k, (v, lease) in sorted(self.keys.items()) if k.startswith(prefix)]}


def test_a_replica_sees_the_ranks_of_its_leaders_host_run_out_with_it():
    """Ranks 0 and 1 run on the leader's host (10.0.0.1), rank 2 on this replica's. All
    three stop renewing at 1.0 s but rank 1 goes on late, from 2.6 s (1.6 s of silence,
    within the TTL): rank 0 leaves the list at its expiry (3.0 s, within two readings)
    though etcd still
    lists its key, rank 1 never does, and rank 2's lease is never read (its host did not
    lead; a rank that dies alone is seen through its control connection)."""
    clock = Clock()
    etcd = FakeEtcd(clock)
    store = EtcdMembershipStore(parse_store_url("etcd://127.0.0.1:1/t"), kv=etcd)
    etcd.put(store.key("leader"), b"10.0.0.1:4000", 100)
    for rank, host in ((0, "10.0.0.1"), (1, "10.0.0.1"), (2, "10.0.0.2")):
        info = {"rank": rank, "pid": 10 + rank, "host": host}
        etcd.put(store.key(f"{RANKS}{rank}"), json.dumps(info).encode(), 200 + rank)
    live = LiveRanks(store, "10.0.0.2:4000", clock=clock)
    dropped_at = None
    while clock.now < 5.0:
        if clock.now < 1.0 or clock.now in (2.6, 3.2, 3.8, 4.4):
            etcd.keep_alive(201)
        if clock.now < 1.0:
            etcd.keep_alive(200)
        seen = live()
        assert seen.get(1) == 11 and seen.get(2) == 12, (clock.now, seen)
        if dropped_at is None and 0 not in seen:
            dropped_at = clock.now
        clock.now = round(clock.now + 0.1, 6)
    assert dropped_at is not None and 3.0 <= dropped_at <= 3.21, dropped_at
    assert store.key(f"{RANKS}0") in etcd.keys  # etcd had not deleted it
    assert set(etcd.reads) == {200, 201}


def test_a_leader_that_never_saw_another_reads_no_lease():
    """The first leader's own replica: no other leader's host to watch."""
    clock = Clock()
    etcd = FakeEtcd(clock)
    store = EtcdMembershipStore(parse_store_url("etcd://127.0.0.1:1/t"), kv=etcd)
    etcd.put(store.key("leader"), b"10.0.0.1:4000", 100)
    etcd.put(store.key(f"{RANKS}0"), json.dumps({"rank": 0, "pid": 10, "host": "10.0.0.1"})
             .encode(), 200)
    live = LiveRanks(store, "10.0.0.1:4000", clock=clock)
    for _ in range(30):
        assert live() == {0: 10}
        clock.now += 0.1
    assert etcd.reads == []
