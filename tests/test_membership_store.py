"""The membership-store seam without a network: the durable state's JSON round trip
(through a live service, a transition in flight included), the embedded store's fencing
and claim, and the parsing of ``--membership-store``."""

import pytest
from _store_fakes import DownStore

from elasticep.membership.durable_state import MembershipState
from elasticep.membership.errors import FencedCommitError, PrefixInUseError
from elasticep.membership.messages import (
    EpochReport,
    PublishDeployment,
    RankHello,
    Register,
    Reply,
    SupervisorHello,
)
from elasticep.membership.service import MembershipService
from elasticep.membership.store import MemoryStore, StoreSpec, parse_store_url
from elasticep.membership.transitions import OnFailure, SlotState

SUP = 100


def _ok(svc, conn, msg):
    sends = svc.handle(conn, msg)
    refused = [s.msg for s in sends if isinstance(s.msg, Reply) and not s.msg.ok]
    assert not refused, refused
    return sends


def _service_mid_failure() -> MembershipService:
    """4 ranks, WORLD registered, a deployment published, a scale target set, and
    rank 2 dead with its failure transition announced but not committed."""
    svc = MembershipService(store_port=1, clock=lambda: 0.0)
    for r in range(3):  # slot 3 is free capacity
        _ok(svc, r, RankHello(rank=r, pid=100 + r, world_size=4, max_world_size=4,
                              is_extension=False, id=1))
        _ok(svc, r, Register("world", [0, 1, 2, 3], [0, 1, 2], OnFailure.COMPLETE, False,
                             id=2))
    _ok(svc, SUP, SupervisorHello(id=1))
    _ok(svc, SUP, PublishDeployment('{"model": "tiny"}', 3, 4, id=2))
    svc.closed(2)
    g = svc.group("world")
    assert g.transition is not None and g.transition.dead == {2}
    _ok(svc, 0, EpochReport("world", g.transition.epoch, 5, 5, [4, 5]))
    return svc


def test_durable_state_round_trips_through_json_and_a_new_service():
    svc = _service_mid_failure()
    state = svc.durable_state()
    assert MembershipState.from_json(state.to_json()) == state
    g = state.groups["world"]
    assert g["states"] == ["healthy", "healthy", "failed", "free"]
    assert g["transition"]["dead"] == [2] and g["transition"]["new_active"] == [0, 1]
    assert state.target == {"ep_size": 3, "max_ep_size": 4, "up": [], "down": [],
                            "members": [0, 1, 2], "retired": []}
    assert state.limits == {"min_holding_ranks": 1, "scale_timeout_s": 600.0}

    fresh = MembershipService(store_port=1, clock=lambda: 0.0)
    fresh.restore(MembershipState.from_json(state.to_json()))
    assert fresh.durable_state() == state
    world = fresh.group("world")
    assert world.states[2] == SlotState.FAILED and world.epoch == 0
    assert world.transition.reports == {}  # re-collected from the reconnected ranks


def test_unknown_state_format_is_refused_in_one_line():
    with pytest.raises(ValueError, match="unknown format 99"):
        MembershipState.from_json('{"format": 99}')


def test_memory_store_fences_a_stale_writer_and_refuses_a_second_owner():
    store = MemoryStore()
    store.claim("dep-a")
    store.claim("dep-a")  # a replica of the same deployment
    with pytest.raises(PrefixInUseError):
        store.claim("dep-b")
    state, rev = store.load()
    assert state is None and rev == 0
    s1 = MembershipState(max_world_size=4)
    rev1 = store.commit(s1, rev)
    with pytest.raises(FencedCommitError):
        store.commit(MembershipState(max_world_size=8), rev)  # read before rev1
    assert store.load() == (s1, rev1)


@pytest.mark.parametrize("url, spec", [
    (None, StoreSpec()),
    ("embedded", StoreSpec()),
    ("etcd://10.0.0.1:2379", StoreSpec("etcd", (("10.0.0.1", 2379),), "elasticep")),
    ("etcd://a:1,b:2/prod/x/", StoreSpec("etcd", (("a", 1), ("b", 2)), "prod/x")),
    ("etcd://[::1]:2379", StoreSpec("etcd", (("::1", 2379),), "elasticep")),
])
def test_parse_store_url(url, spec):
    assert parse_store_url(url) == spec


@pytest.mark.parametrize("url", ["redis://a:1", "etcd://", "etcd://a", "etcd://a:0",
                                 "etcd://a:1,b", "a:1"])
def test_parse_store_url_refuses_in_one_line(url):
    with pytest.raises(ValueError, match="membership-store") as e:
        parse_store_url(url)
    assert "\n" not in str(e.value)


def test_the_persister_reports_an_unavailable_store_and_catches_up_when_it_is_back():
    from elasticep.membership.persister import StatePersister

    store = DownStore()
    current = [MembershipState(max_world_size=1)]
    p = StatePersister(store, lambda: current[0], revision=0)
    try:
        assert p.wait_committed(5) and store.load()[0] == current[0]
        store.down = True
        current[0] = MembershipState(max_world_size=2)
        p.changed()
        assert not p.wait_committed(1.0)
        health = p.health()
        assert not health.ok and not health.deposed
        assert health.reason == "membership store unavailable: no etcd member answered (test)"
        current[0] = MembershipState(max_world_size=3)  # changes go on meanwhile
        p.changed()
        store.down = False
        assert p.wait_committed(5)  # the retry commits the newest state
        assert store.load()[0] == MembershipState(max_world_size=3) and p.health().ok
    finally:
        p.close()


def test_a_commit_that_timed_out_but_went_through_is_adopted_not_taken_for_a_rival():
    """etcd loses quorum; a write reported as failed is applied later (a lone member
    logged it and committed it once quorum returned). When etcd is back the next
    commit names a stale revision and is fenced, but the stored state is the
    persister's own, so it adopts that revision and goes on, not deposed."""
    from elasticep.membership.errors import StoreUnavailableError
    from elasticep.membership.persister import StatePersister

    class _OutageStore(MemoryStore):
        down = late = False

        def commit(self, state, expected_revision):
            if self.down and self.late:
                self.late = False
                super().commit(state, expected_revision)
                raise StoreUnavailableError("timed out (applied all the same)")
            if self.down:
                raise StoreUnavailableError("no quorum")
            return super().commit(state, expected_revision)

        def load(self):
            if self.down:
                raise StoreUnavailableError("no quorum")
            return super().load()

    store = _OutageStore()
    current = [MembershipState(max_world_size=1)]
    p = StatePersister(store, lambda: current[0], revision=0)
    try:
        assert p.wait_committed(5)
        store.down = store.late = True
        current[0] = MembershipState(max_world_size=2)
        p.changed()
        assert not p.wait_committed(1.0) and not p.health().ok
        current[0] = MembershipState(max_world_size=3)
        p.changed()
        store.down = False
        assert p.wait_committed(5)
        assert MemoryStore.load(store) == (MembershipState(max_world_size=3), 3)
        assert p.health().ok and not p.health().deposed
    finally:
        p.close()
