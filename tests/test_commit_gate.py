"""Epoch commits wait for the membership store (elasticep.membership.commit_gate), and a
planned change waits while the store cannot take its commit (the service's
``changes_allowed``). Pure: no store, no sockets."""

import queue
import threading
import time
from contextlib import contextmanager

from _store_fakes import DownStore

from elasticep.membership import messages as m
from elasticep.membership import start_coordinator
from elasticep.membership.commit_gate import CommitGate
from elasticep.membership.protocol import connect
from elasticep.membership.service import MembershipService, SendOnConn
from elasticep.membership.store import MemoryStore
from elasticep.membership.transitions import OnFailure, SlotState, decide
from elasticep.utils.wait import wait_until


def _commit(epoch: int) -> m.Commit:
    d = decide("change", epoch, {0, 1}, set(), {})
    return m.Commit("world", [SlotState.HEALTHY] * 2, {"admit": [], "remove": []}, decision=d)


def test_a_commit_and_what_follows_it_on_its_connection_wait_until_the_store_has_it():
    gate = CommitGate()
    commit, announce = _commit(3), m.Announce("world", 4)
    out = gate.route([SendOnConn(1, commit), SendOnConn(1, announce),
                      SendOnConn(2, m.Reply(id=7, ok=True)),
                      SendOnConn(1, m.HeartbeatAck())], change=5)
    # another connection's reply and a heartbeat ack (no state) go at once
    assert [(s.conn, type(s.msg)) for s in out] == [(2, m.Reply), (1, m.HeartbeatAck)]
    assert gate.held() == 2
    assert gate.confirm(4) == []  # the store has an older state only
    assert [s.msg for s in gate.confirm(5)] == [commit, announce]  # in order
    assert gate.held() == 0
    # once the store has a change, a commit of it goes at once
    assert [s.msg for s in gate.route([SendOnConn(1, commit)], change=5)] == [commit]


def test_a_later_commit_waits_for_its_own_change_and_a_closed_connection_drops_its_sends():
    gate = CommitGate()
    first, second = _commit(3), _commit(4)
    assert gate.route([SendOnConn(1, first)], change=5) == []
    assert gate.route([SendOnConn(1, m.Announce("world", 4)), SendOnConn(1, second)],
                      change=7) == []
    assert gate.route([SendOnConn(2, first)], change=5) == []
    out = gate.confirm(6)
    assert [(s.conn, s.msg) for s in out] == [(1, first), (1, m.Announce("world", 4)),
                                              (2, first)]
    gate.drop(1)
    assert gate.confirm(7) == [] and gate.held() == 0


def test_decisions_are_committed_in_order_once_the_store_has_them_or_refused():
    gate = CommitGate()
    assert not gate.decided("e1", change=2) and not gate.decided("e2", change=3)
    gate.confirm(2)
    assert gate.take_committed() == ["e1"] and gate.take_committed() == []
    gate.confirm(3)
    assert gate.take_committed() == ["e2"]
    assert gate.decided("now", change=3)  # the store has that change already
    assert not gate.decided("e3", change=4) and not gate.decided("e4", change=5)
    assert gate.refuse() == ["e3", "e4"]  # never confirmed: no member received them
    gate.confirm(9)
    assert gate.take_committed() == []


def _two_ranks() -> MembershipService:
    svc = MembershipService(store_port=1, clock=lambda: 0.0)
    for r in range(2):
        svc.handle(r, m.RankHello(rank=r, pid=100 + r, world_size=2, max_world_size=2,
                                  is_extension=False, id=1))
        svc.handle(r, m.Register("world", [0, 1], [0, 1], OnFailure.COMPLETE, False, id=2))
    return svc


def test_a_planned_removal_waits_while_the_store_cannot_take_its_commit():
    svc = _two_ranks()
    allowed = [False]
    svc.changes_allowed = lambda: allowed[0]
    g = svc.group("world")
    svc.handle(9, m.SupervisorHello(id=1))
    sends = svc.handle(9, m.RequestDeactivation("world", [1], id=2))  # a scale-down's intent
    assert g.requests["remove"] == [1]
    peers = [s.msg for s in sends if isinstance(s.msg, m.Peer)]
    # the members do not see the removal (they would drain and wait for a commit)
    assert peers and all(p.requests["remove"] == [] for p in peers)
    sends = svc.handle(0, m.Deactivate("world", [1], id=3))  # a member asks anyway
    assert not any(isinstance(s.msg, m.Announce) for s in sends)
    assert g.transition is None and g.epoch == 0
    allowed[0] = True  # the store is back: the next tick pushes the intent and begins
    sends = svc.tick(0.0)
    assert any(isinstance(s.msg, m.Announce) and s.msg.epoch == 1 for s in sends)
    assert any(isinstance(s.msg, m.Peer) and s.msg.requests["remove"] == [1] for s in sends)


def test_a_death_does_not_wait_for_the_store():
    svc = _two_ranks()
    svc.changes_allowed = lambda: False
    sends = svc.closed(1)
    assert any(isinstance(s.msg, m.Announce) for s in sends)
    assert svc.group("world").transition.dead == {1}


def _reader(conn) -> queue.Queue:
    got: queue.Queue = queue.Queue()

    def run() -> None:
        while (msg := conn.recv()) is not None:
            got.put(msg)
    threading.Thread(target=run, daemon=True).start()
    return got


def _next(got: queue.Queue, kind: type, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = got.get(timeout=left)
        except queue.Empty:
            break
        if isinstance(msg, kind):
            return msg
    return None


def _commit_lines(caplog, epoch: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if f"group world commit epoch {epoch} " in r.getMessage()]


def _two_members(coord) -> tuple[list, list[queue.Queue]]:
    conns, inbox = [], []
    for r in range(2):
        conn = connect(coord.address, 5)
        conns.append(conn)
        inbox.append(_reader(conn))
        conn.send(m.RankHello(rank=r, pid=100 + r, world_size=2, max_world_size=2,
                              is_extension=False, id=1))
        assert _next(inbox[r], m.Reply, 5).ok
        conn.send(m.Register("world", [0, 1], [0, 1], OnFailure.COMPLETE, False, id=2))
        assert _next(inbox[r], m.Reply, 5).ok
    return conns, inbox


@contextmanager
def _epoch_decided_while_the_store_is_down(caplog):
    """A coordinator over a store that is down when rank 1 of 2 dies and rank 0
    reports: epoch 1 is decided; yields (store, coordinator, rank 0's inbox)."""
    caplog.set_level("INFO", logger="elasticep.membership")
    store = DownStore()
    coord = start_coordinator(membership_store=store, hb_timeout_s=30.0)
    conns: list = []
    try:
        conns, inbox = _two_members(coord)
        assert coord.wait_committed(5)
        store.down = True
        conns[1].close()  # rank 1 dies
        announce = _next(inbox[0], m.Announce, 5)
        assert announce is not None and announce.epoch == 1
        conns[0].send(m.EpochReport("world", 1, 3, 3, []))
        yield store, coord, inbox[0]
    finally:
        for c in conns:
            c.close()
        coord.close()


def test_the_coordinator_sends_an_epoch_commit_only_once_the_store_has_it(caplog):
    """A rank dies while the store cannot commit: the survivor gets the announcement
    and reports, but the commit reaches it only after the store took the new state
    (a leader cut off from etcd's majority commits no epoch its successor never sees),
    and the coordinator logs the epoch as committed only then."""
    with _epoch_decided_while_the_store_is_down(caplog) as (store, coord, got):
        assert _next(got, m.Commit, 1.5) is None  # held: the store has not got it
        assert not coord.store_health().ok
        assert _commit_lines(caplog, 1) == []  # decided, not committed
        store.down = False
        commit = _next(got, m.Commit, 5)
        assert commit is not None and commit.epoch == 1
        state, _ = store.load()
        assert state.groups["world"]["epoch"] == 1 and state.groups["world"]["active"] == [0]
        (line,) = _commit_lines(caplog, 1)
        assert "'active': [0]" in line


def test_a_deposed_coordinator_logs_its_held_epoch_as_refused_not_committed(caplog):
    """The store is out of reach when an epoch is decided, and another coordinator
    commits meanwhile: once the store answers, this one's commit is fenced, the epoch
    is logged as refused, and no commit line or Commit message is ever produced."""
    with _epoch_decided_while_the_store_is_down(caplog) as (store, coord, got):
        time.sleep(0.3)
        state, rev = MemoryStore.load(store)
        MemoryStore.commit(store, state, rev)  # a successor's commit
        store.down = False
        wait_until(lambda: coord.store_health().deposed, 5, "the coordinator deposed")
        assert _next(got, m.Commit, 1.0) is None
        assert _commit_lines(caplog, 1) == []
        refused = [r.getMessage() for r in caplog.records
                   if "group world epoch 1 refused, never sent" in r.getMessage()]
        assert len(refused) == 1, refused
