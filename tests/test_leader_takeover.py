"""A new leader taking the ranks back (``membership/takeover.py``): the service restored
from the old leader's durable state takes resuming ranks back in their slots and epochs,
restarts each heartbeat deadline at the takeover, evicts a rank that never comes back
through the usual failure transition, and restarts a transition that was in flight
(without a network). Against a real 3-member etcd on 127.0.0.1: a member whose
``ranks/<rank>`` key is gone fails in the new leader's first epoch, one still listed
keeps its placeholder, and the coordinator keeps looking until each member is back or
failed."""

import uuid

import pytest

from elasticep.membership.directory import RANKS, Announcement, rank_processes
from elasticep.membership.etcd_store import EtcdMembershipStore
from elasticep.membership.lease_watch import LiveRanks
from elasticep.membership.messages import (
    Announce,
    Commit,
    EpochReport,
    Evicted,
    GetDeploymentStatus,
    PublishDeployment,
    RankHello,
    RecordLaunch,
    Register,
    Reply,
    SupervisorHello,
)
from elasticep.membership.server import start_coordinator
from elasticep.membership.service import MembershipService
from elasticep.membership.store import parse_store_url
from elasticep.membership.transitions import OnFailure, SlotState
from elasticep.utils.wait import wait_until
from elasticep_testkit.etcd_cluster import EtcdCluster

HB_S = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _ok(svc, conn, msg):
    sends = svc.handle(conn, msg)
    refused = [s.msg for s in sends if isinstance(s.msg, Reply) and not s.msg.ok]
    assert not refused, refused
    return sends


def _old_leader(n: int = 3) -> MembershipService:
    svc = MembershipService(store_port=1, hb_timeout_s=HB_S, clock=lambda: 0.0)
    for r in range(n):
        _ok(svc, r, RankHello(r, 100 + r, n, n, False, id=1))
        _ok(svc, r, Register("world", list(range(n)), list(range(n)), OnFailure.COMPLETE,
                             False, id=2))
    return svc


def _new_leader(old: MembershipService, clock: Clock) -> MembershipService:
    svc = MembershipService(store_port=2, hb_timeout_s=HB_S, clock=clock)
    svc.restore(old.durable_state())
    return svc


def _announced(sends) -> dict[int, int]:
    """connection -> announced epoch, for the connections a server has (ids from 1)."""
    return {s.conn: s.msg.epoch for s in sends if isinstance(s.msg, Announce) and s.conn > 0}


def _resume(svc, conn, rank, epoch, pid=None, pending=0):
    return svc.handle(conn, RankHello(rank, pid or 100 + rank, 3, 3, False,
                                      resume={"world": [epoch, pending]}, id=1))


def test_resuming_ranks_are_taken_back_in_place_with_the_new_store_port():
    clock = Clock()
    svc = _new_leader(_old_leader(), clock)
    # before they are back, the status names the old leader's pids (the front-end
    # keeps routing to them)
    assert {r: p["pid"] for r, p in svc._status(None, None)["ranks"].items()} == {
        "0": 100, "1": 101, "2": 102}
    clock.now = 100.0  # long after the restore: only the deadlines matter
    for r in range(3):
        (reply,) = [s.msg for s in _resume(svc, 10 + r, r, 0)]
        assert reply.ok and reply["store_port"] == 2
    g = svc.group("world")
    assert g.epoch == 0 and g.active == {0, 1, 2} and g.transition is None
    assert svc.tick(clock.now + HB_S / 2) == []  # nobody evicted: deadlines restarted


def test_a_live_member_reconnecting_to_its_own_coordinator_is_taken_back():
    """A rank whose connection dropped while the coordinator still held it (a stopping
    leader, whose key in etcd the rank read before it was gone) comes back on a new
    connection with its own pid: taken back, and the old connection's close, seen
    later, fails nobody. Another pid for a held slot is still refused. (It was refused
    as 'already held by live pid' with its own pid, and the rank exited.)"""
    svc = _old_leader()
    (reply,) = [s.msg for s in _resume(svc, 10, 1, 0)]
    assert reply.ok, reply
    assert svc.closed(1) == [] and svc.group("world").transition is None
    assert svc.group("world").states[1] == SlotState.HEALTHY
    (reply,) = [s.msg for s in _resume(svc, 11, 2, 0, pid=999)]
    assert not reply.ok and reply.error == "slot 2 is already held by live pid 102"
    sends = svc.closed(10)  # the new connection's close is the rank's death again
    assert svc.group("world").transition is not None, sends


def test_a_new_leader_knows_the_node_of_each_rank_before_any_launcher_is_back():
    """The launch records' nodes are durable: a new leader's status (and a node's
    retirement, and a stopping node's search for members handed over to it) does not
    take every rank for node 0's while the launchers have not reconnected yet."""
    old = _old_leader()
    _ok(old, 20, SupervisorHello(id=1))
    _ok(old, 20, PublishDeployment("{}", 3, 3, id=9))
    for rank, node in ((0, 0), (1, 0), (2, 1)):
        _ok(old, 20, RecordLaunch(rank, 100 + rank, node, id=2 + rank))
    svc = _new_leader(old, Clock())
    (reply,) = [s.msg for s in _ok(svc, 30, GetDeploymentStatus(id=1))]
    assert {r["rank"]: r["node"] for r in reply["status"]["ranks"]} == {0: 0, 1: 0, 2: 1}


def test_a_rank_not_back_within_the_heartbeat_timeout_fails_and_the_rest_go_on():
    clock = Clock()
    clock.now = 50.0  # the takeover, long after the ranks' last heartbeat to the old one
    svc = _new_leader(_old_leader(), clock)
    clock.now = 51.0
    _resume(svc, 10, 0, 0)
    _resume(svc, 11, 1, 0)
    assert svc.tick(50 + HB_S - 0.1) == []  # within the deadline counted from the restore
    sends = svc.tick(51 + HB_S - 0.1)  # rank 2 never came back
    announces = {s.conn: s.msg for s in sends if isinstance(s.msg, Announce)}
    assert set(announces) == {10, 11} and all(a.epoch == 1 for a in announces.values())
    for conn in (10, 11):
        _ok(svc, conn, EpochReport("world", 1, 5, 5, []))
    g = svc.group("world")
    assert g.epoch == 1 and g.active == {0, 1} and g.states[2] == SlotState.FAILED
    # its late hello is refused: the slot was declared dead meanwhile
    (reply,) = [s.msg for s in _resume(svc, 12, 2, 0)]
    assert not reply.ok and "holds no member" in reply.error


def test_a_transition_in_flight_is_restarted_at_a_fresh_epoch():
    old = _old_leader()
    old.closed(2)  # rank 2 died: the old leader announced epoch 1 and died too
    assert old.group("world").transition.epoch == 1
    clock = Clock()
    svc = _new_leader(old, clock)
    sends = _resume(svc, 10, 0, 0, pending=1)  # it saw the announcement of epoch 1
    # (rank 1, not back yet, is sent nothing: its placeholder has no connection)
    assert _announced(sends) == {10: 2}
    assert _announced(_resume(svc, 11, 1, 0, pending=1)) == {11: 2}
    _ok(svc, 10, EpochReport("world", 2, 7, 7, []))
    sends = _ok(svc, 11, EpochReport("world", 2, 7, 7, []))
    commits = [s for s in sends if isinstance(s.msg, Commit)]
    assert {s.conn for s in commits} == {10, 11}
    d = commits[0].msg.decision
    assert d.epoch == 2 and d.active == (0, 1) and d.dead == (2,)


def test_an_epoch_the_store_missed_gets_a_fresh_one_over_the_stored_members():
    clock = Clock()
    svc = _new_leader(_old_leader(), clock)
    # the old leader committed epoch 4 only in memory
    assert _announced(_resume(svc, 10, 0, 4)) == {10: 5}
    for r in (1, 2):
        assert _announced(_resume(svc, 10 + r, r, 0)) == {10 + r: 5}
    for r in range(3):
        _ok(svc, 10 + r, EpochReport("world", 5, 9, 9, []))
    assert svc.group("world").epoch == 5 and svc.group("world").active == {0, 1, 2}


def test_a_rank_left_waiting_for_a_commit_gets_a_fresh_epoch():
    """The store holds epoch 1 with no transition, but the old leader had announced
    epoch 2 (only in memory) before it died: a rank that reported for it would wait for
    its commit forever, so a fresh epoch is announced."""
    old = _old_leader()
    g = old.group("world")
    g.epoch = g.max_epoch = 1  # as if epoch 1 had committed (same members)
    svc = _new_leader(old, Clock())
    assert _announced(_resume(svc, 10, 0, 1)) == {}  # at the stored epoch: nothing to do
    assert _announced(_resume(svc, 11, 1, 1)) == {}
    assert _announced(_resume(svc, 12, 2, 1, pending=2)) == {10: 3, 11: 3, 12: 3}


def test_a_second_hello_for_a_taken_back_slot_is_refused():
    svc = _new_leader(_old_leader(), Clock())
    _resume(svc, 10, 0, 0)
    (reply,) = [s.msg for s in _resume(svc, 11, 0, 0, pid=999)]
    assert not reply.ok and "already held by live pid 100" in reply.error
    # another process than the one the old leader had in a slot is not taken back
    (reply,) = [s.msg for s in _resume(svc, 11, 1, 0, pid=999)]
    assert not reply.ok and "was held by pid 101, not 999" in reply.error
    # and a rank the old leader never had is no member here
    (reply,) = [s.msg for s in svc.handle(12, RankHello(0, 5, 3, 4, False, resume={}, id=1))]
    assert not reply.ok and "max_world_size 4" in reply.error
    evicted = [s for s in svc.tick(100.0) if isinstance(s.msg, Evicted)]
    assert 10 in {s.conn for s in evicted}  # a resumed rank is timed like any other


@pytest.fixture(scope="module")
def etcd_url():
    with EtcdCluster.start(3) as c:
        yield c.url


def _rank_keys(store, pids: dict[int, int]) -> list[Announcement]:
    """``ranks/<rank>`` keys as live rank processes keep them (here with made-up pids)."""
    keys = [Announcement(store, RANKS, str(r), {"rank": r, "pid": pid}, 2)
            for r, pid in pids.items()]
    for k in keys:
        k.start()
    return keys


@pytest.mark.timeout(30)
def test_a_new_leader_fails_at_once_the_ranks_etcd_no_longer_lists(etcd_url):
    """Rank 2 has no key (its lease ran out with its host), rank 1's names another
    process: both fail in the new leader's first epoch. Rank 0, listed as the process
    the state names, keeps its placeholder and a deadline counted from the takeover."""
    store = EtcdMembershipStore(parse_store_url(f"{etcd_url}/t-{uuid.uuid4().hex[:8]}"))
    keys = _rank_keys(store, {0: 100, 1: 999})
    try:
        clock = Clock()
        clock.now = 50.0  # long after the ranks' last heartbeat to the old leader
        svc = _new_leader(_old_leader(), clock)
        assert rank_processes(store) == {0: 100, 1: 999}
        sends = svc.vanished(rank_processes(store))
        assert [s for s in sends if s.conn > 0] == []  # nobody is connected yet
        tr = svc.group("world").transition
        assert tr.epoch == 1 and tr.dead == {1, 2} and tr.new_active == {0}
        assert svc.awaiting_resume
        assert svc.tick(50 + HB_S - 0.1) == []  # rank 0 kept: its deadline restarted
        assert _announced(_resume(svc, 10, 0, 0)) == {10: 1}
        sends = _ok(svc, 10, EpochReport("world", 1, 5, 5, []))
        (commit,) = [s.msg for s in sends if isinstance(s.msg, Commit)]
        assert commit.decision.active == (0,) and commit.decision.dead == (1, 2)
        assert not svc.awaiting_resume
        (reply,) = [s.msg for s in _resume(svc, 11, 1, 0, pid=999)]
        assert not reply.ok and "holds no member" in reply.error
    finally:
        for k in keys:
            k.close()
        store.close()


@pytest.mark.timeout(30)
def test_a_coordinator_taking_over_fails_a_rank_when_its_key_goes(etcd_url):
    """The coordinator (its server, not only the service) reads etcd's list after the
    takeover until every member is back or failed: rank 2, never listed, fails at once;
    rank 1, whose key goes only after the takeover (its lease outlived the old
    leader's), fails then; rank 0 is still awaited, well within its heartbeat timeout."""
    url = f"{etcd_url}/t-{uuid.uuid4().hex[:8]}"
    store = EtcdMembershipStore(parse_store_url(url))
    store.commit(_old_leader().durable_state(), 0)
    keys = _rank_keys(store, {0: 100, 1: 101})
    coord = start_coordinator(membership_store=EtcdMembershipStore(parse_store_url(url)),
                              hb_timeout_s=30.0,
                              rank_processes=LiveRanks(store, "new-leader:1").start())
    try:
        def dead() -> set[int]:
            tr = coord.service.group("world").transition
            return set() if tr is None else tr.dead

        wait_until(lambda: dead() == {2}, 3, "rank 2 failed", poll_s=0.02)
        keys[1].close()  # as if its lease had expired just after the takeover
        wait_until(lambda: dead() == {1, 2}, 3, "rank 1 failed", poll_s=0.02)
        assert coord.service.awaiting_resume  # rank 0's placeholder
        assert coord.service.group("world").states[0] == SlotState.HEALTHY
    finally:
        coord.close()
        for k in keys:
            k.close()
        store.close()
