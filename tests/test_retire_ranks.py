"""Retiring chosen ranks and draining a node, as pure decisions and through the
membership service (no sockets): plans, refusals, operation ids and their states."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from elasticep.membership.control_wire import ControlMessage as Message
from elasticep.membership.errors import (
    OperationConflictError,
    OperationNotFoundError,
    ScaleInProgressError,
    ScaleRefusedError,
)
from elasticep.membership.messages import (
    ClearLaunch,
    Deactivate,
    EpochReport,
    GetDeploymentStatus,
    GetOperation,
    Heartbeat,
    PublishDeployment,
    RankHello,
    RecordLaunch,
    Register,
    Reply,
    Reserve,
    Retire,
    Scale,
    SupervisorHello,
)
from elasticep.membership.operations import Operation, OperationLog, op_view, rank_op_state
from elasticep.membership.scaling import ScaleTarget, check_join
from elasticep.membership.service import MembershipService
from elasticep.membership.status import DeploymentStatus
from elasticep.membership.transitions import OnFailure, SlotState
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(30)

SUP = 100  # the supervisor's connection id (ranks use their rank)


def _states(*names: str) -> list[SlotState]:
    return [SlotState(n) for n in names]


# ---- ScaleTarget.retire: pure ---------------------------------------------------------
def test_retire_takes_the_chosen_slots_out_not_the_highest():
    t = ScaleTarget(4, 4)
    plan = t.retire([1], _states(*["healthy"] * 4))
    assert plan.remove == (1,) and plan.admit == () and plan.free == ()
    assert plan.reply == {"old_ep_size": 4, "slots": [1], "scale_phase": "draining"}
    assert t.members == {0, 2, 3} and t.ep_size == 3 and t.retired == {1}
    assert t.phase(_states("healthy", "draining", "healthy", "healthy")) == "draining"
    assert t.phase(_states("healthy", "free", "healthy", "healthy")) == "idle"
    # a later shrink removes the highest of the target; a grow refills the retired slot
    assert t.plan(2, _states("healthy", "free", "healthy", "healthy")).remove == (3,)
    assert t.members == {0, 2}
    t.phase(_states("healthy", "free", "healthy", "free"))
    plan = t.plan(3, _states("healthy", "free", "healthy", "free"))
    assert plan.admit == (1,) and t.members == {0, 1, 2} and t.retired == set()


def test_retiring_a_failed_rank_frees_it_at_once():
    """The issue's case: rank 1 dead, `new_ep_size 3` drained the healthy rank 3;
    retiring rank 1 keeps the three healthy ones."""
    t = ScaleTarget(4, 4)
    plan = t.retire([1], _states("healthy", "failed", "healthy", "healthy"))
    assert plan.remove == () and plan.free == (1,) and t.members == {0, 2, 3}


def test_retire_refusals_change_nothing():
    t = ScaleTarget(4, 6)
    states = _states("healthy", "failed", "healthy", "healthy", "free", "free")
    with pytest.raises(ScaleRefusedError, match=r"no healthy rank \(rank 1 is failed\)"):
        t.retire([0, 2, 3], states)
    with pytest.raises(ScaleRefusedError, match=r"leave 1 healthy ranks \(\[0\]\), but every "
                                                r"expert needs at least 2"):
        t.retire([2, 3], states, min_holding_ranks=2)
    with pytest.raises(ValueError, match="rank 4 is free, not in the deployment's target"):
        t.retire([4], states)
    with pytest.raises(ValueError, match="outside the capacity"):
        t.retire([6], states)
    with pytest.raises(ValueError, match="distinct"):
        t.retire([2, 2], states)
    with pytest.raises(ScaleInProgressError, match="rank 1 is joining"):
        t.retire([1], _states("healthy", "joining", "healthy", "healthy", "free", "free"))
    assert t.members == {0, 1, 2, 3} and not t.down and not t.retired
    t.plan(5, states)  # a grow waits for its joiner: no retirement meanwhile
    with pytest.raises(ScaleInProgressError):
        t.retire([2], states)


def test_a_retired_slot_may_come_back_with_join_recover():
    t = ScaleTarget(4, 4)
    t.retire([1], _states(*["healthy"] * 4))
    after = _states("healthy", "free", "healthy", "healthy")
    t.phase(after)
    check_join("recover", [1], after, [0, 1, 2, 3], t, {}, {})  # no refusal
    t.readmit(1)
    assert t.members == {0, 1, 2, 3} and t.ep_size == 4


# ---- operations: pure -----------------------------------------------------------------
def test_rank_op_states_and_phases():
    op = Operation("a", {"retire_ranks": [1, 2]}, (1, 2), leaving=True)
    view = op_view(op, _states("healthy", "draining", "healthy"), {1: True, 2: True})
    assert view == {"operation_id": "a", "request": {"retire_ranks": [1, 2]},
                    "phase": "draining", "ranks": [{"rank": 1, "state": "draining"},
                                                   {"rank": 2, "state": "active"}]}
    view = op_view(op, _states("healthy", "free", "free"), {1: False, 2: True})
    assert view["phase"] == "retiring" and [r["state"] for r in view["ranks"]] == [
        "safe_to_terminate", "retired"]
    assert op_view(op, _states("healthy", "free", "failed"), {})["phase"] == "done"
    grow = Operation("g", {"new_ep_size": 3}, (2,), leaving=False)
    assert op_view(grow, _states("healthy", "healthy", "ready"), {})["phase"] == (
        "waiting_for_joiners")
    assert rank_op_state(SlotState.HEALTHY, False, True) == "active"
    assert op_view(grow, _states("healthy", "healthy", "free"), {},
                   timed_out=True)["phase"] == "timed_out"


def test_operation_log_repeats_and_conflicts():
    log = OperationLog()
    assert log.repeat(None, {"new_ep_size": 3}) is None
    op = log.add(Operation(log.new_id(), {"new_ep_size": 3}, (3,), True))
    assert op.id == "op-1" and log.repeat("op-1", {"new_ep_size": 3}) is op
    with pytest.raises(OperationConflictError, match="use a new operation_id"):
        log.repeat("op-1", {"new_ep_size": 2})
    with pytest.raises(OperationNotFoundError):
        log.get("op-9")
    log.add(Operation("op-2", {"drain_node": 1}, (2,), True))  # a caller's id
    assert log.new_id() == "op-3"


# ---- through the membership service (no sockets) --------------------------------------
def _ok(svc: MembershipService, conn: int, msg: Message) -> dict:
    """The reply's body to ``msg`` on ``conn``; fails on a refusal."""
    replies = [s.msg for s in svc.handle(conn, msg) if isinstance(s.msg, Reply)]
    assert replies and replies[-1].ok, replies
    return replies[-1].body


def _refused(svc: MembershipService, msg: Message) -> Reply:
    replies = [s.msg for s in svc.handle(SUP, msg) if isinstance(s.msg, Reply)]
    assert replies and not replies[-1].ok, replies
    return replies[-1]


def _deployment(n: int, nodes: dict[int, int], min_holding: int = 1) -> MembershipService:
    """``n`` healthy ranks registered in WORLD, launched on ``nodes`` (rank -> node), and
    the supervisor that published the deployment."""
    svc = MembershipService(store_port=1, clock=lambda: 0.0)
    for r in range(n):
        _ok(svc, r, RankHello(rank=r, pid=100 + r, world_size=n, max_world_size=n,
                                  is_extension=False, id=1))
        _ok(svc, r, Register("world", list(range(n)), list(range(n)), OnFailure.COMPLETE,
                             False, id=2))
    _ok(svc, SUP, SupervisorHello(id=1))
    _ok(svc, SUP, PublishDeployment("{}", n, n, min_holding, id=2))
    for r, node in nodes.items():
        _ok(svc, SUP, RecordLaunch(r, 100 + r, node=node, id=3))
    return svc


def _growable(n: int, capacity: int, min_holding: int = 1, scale_timeout_s: float = 600.0,
              clock: Callable[[], float] = lambda: 0.0) -> MembershipService:
    """``n`` healthy ranks of a WORLD of ``capacity`` slots (the rest free), published."""
    svc = MembershipService(store_port=1, clock=clock)
    for r in range(n):
        _ok(svc, r, RankHello(rank=r, pid=100 + r, world_size=n, max_world_size=capacity,
                              is_extension=False, id=1))
        _ok(svc, r, Register("world", list(range(capacity)), list(range(n)),
                             OnFailure.COMPLETE, False, id=2))
    _ok(svc, SUP, SupervisorHello(id=1))
    _ok(svc, SUP, PublishDeployment("{}", n, capacity, min_holding, scale_timeout_s, id=2))
    for r in range(n):  # launched on node 0 (a rank with no launch is on no node)
        _ok(svc, SUP, RecordLaunch(r, 100 + r, node=0, id=3))
    return svc


def _remove_voted(svc: MembershipService, slots: list[int]) -> None:
    """The members vote the removal at a step boundary and report: it commits."""
    g = svc.group("world")
    _ok(svc, 0, Deactivate("world", slots, id=5))
    epoch = g.transition.epoch
    for s in sorted(g.transition.waiting):
        svc.handle(s, EpochReport("world", epoch, 5, 5, []))  # no answer
    assert g.transition is None


def _status(svc: MembershipService) -> DeploymentStatus:
    return DeploymentStatus.from_dict(_ok(svc, SUP, GetDeploymentStatus(id=7))["status"])


def test_retire_rank_1_of_4_with_an_operation_id_end_to_end():
    svc = _deployment(4, {r: 0 for r in range(4)}, min_holding=2)
    g = svc.group("world")
    reply = _ok(svc, SUP, Retire(ranks=[1], operation_id="maint-7", id=10))
    assert reply == {"old_ep_size": 4, "slots": [1], "scale_phase": "draining",
                     "operation_id": "maint-7"}
    assert g.states[1] == "draining" and g.requests["remove"] == [1]
    op = _ok(svc, SUP, GetOperation("maint-7", id=11))["operation"]
    assert op["phase"] == "draining" and op["ranks"] == [{"rank": 1, "state": "draining"}]
    # the same request again (a retry after a lost answer): nothing changes
    again = _ok(svc, SUP, Retire(ranks=[1], operation_id="maint-7", id=12))
    assert again == {**reply, "repeated": True} and g.requests["remove"] == [1]
    conflict = _refused(svc, Retire(ranks=[2], operation_id="maint-7", id=13))
    assert conflict.code == "operation_conflict"
    busy = _refused(svc, Retire(ranks=[2], id=14))
    assert busy.code == "scale_in_progress"
    _remove_voted(svc, [1])
    assert g.states == ["healthy", "free", "healthy", "healthy"]
    op = _ok(svc, SUP, GetOperation("maint-7", id=15))["operation"]
    assert op["phase"] == "retiring" and op["ranks"] == [{"rank": 1, "state": "retired"}]
    svc.closed(1)  # the removed worker exits, and its launcher saw it go
    _ok(svc, SUP, ClearLaunch(1, 101, id=21))
    op = _ok(svc, SUP, GetOperation("maint-7", id=16))["operation"]
    assert op["phase"] == "done" and op["ranks"] == [{"rank": 1, "state": "safe_to_terminate"}]
    st = _status(svc)
    assert st.ep_size == 3 and st.healthy_ranks() == [0, 2, 3] and not st.degraded()
    assert st.scale_phase == "idle"
    # the rest keep 3 healthy ranks of which 2 must hold the experts: one more may go
    # (shrinks get an id too), two more may not
    refused = _refused(svc, Retire(ranks=[2, 3], id=17))
    assert refused.code == "scale_refused" and "at least 2" in refused.error
    assert _refused(svc, GetOperation("nope", id=18)).code == "operation_not_found"
    # the retired slot comes back in place with `join` in recover mode
    _ok(svc, SUP, Reserve([1], "recover", "join pid 9", id=19))
    assert _status(svc).ep_size == 4
    assert _ok(svc, SUP, Scale(4, id=20))["operation_id"] == "op-1"


def test_drain_node_retires_every_rank_launched_there():
    svc = _deployment(6, {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1}, min_holding=2)
    reply = _ok(svc, SUP, Retire(node=1, id=10))
    assert reply["slots"] == [4, 5] and reply["operation_id"] == "op-1"
    assert svc.group("world").states[4:] == ["draining", "draining"]
    assert _refused(svc, Retire(node=3, id=11)).code == "refused"  # busy: the drain runs
    _remove_voted(svc, [4, 5])
    assert "runs no rank" in _refused(svc, Retire(node=3, id=12)).error
    assert "either retire_ranks or drain_node" in _refused(
        svc, Retire(ranks=[1], node=0, id=13)).error
    for r in (4, 5):
        svc.closed(r)
        _ok(svc, SUP, ClearLaunch(r, 100 + r, id=15))
    op = _ok(svc, SUP, GetOperation("op-1", id=14))["operation"]
    assert op["request"] == {"drain_node": 1} and op["phase"] == "done"
    assert _status(svc).healthy_ranks() == [0, 1, 2, 3]


def test_a_grow_waiting_for_joiners_says_so_and_gives_up_after_the_scale_timeout():
    """POST 4 -> 6 with no `join`: it waited forever. Now the status names the slots it
    waits for, and past --elastic-ep-scale-timeout the slots are freed (ep_size 4 again)
    and the operation reads timed_out."""
    clock = [0.0]
    svc = _growable(4, 6, scale_timeout_s=30.0, clock=lambda: clock[0])
    reply = _ok(svc, SUP, Scale(6, operation_id="grow", id=3))
    assert reply["scale_phase"] == "waiting_for_joiners" and reply["slots"] == [4, 5]
    st = _status(svc)
    assert st.waiting_slots == (4, 5) and st.to_dict()["waiting_slots"] == [4, 5]

    def tick(now: float) -> None:
        clock[0] = now
        for r in range(4):  # the members stay alive meanwhile
            svc.handle(r, Heartbeat())
        svc.tick(now)

    tick(29.0)
    assert _status(svc).ep_size == 6  # not yet
    tick(30.5)
    st = _status(svc)
    assert st.ep_size == 4 and st.scale_phase == "idle" and st.waiting_slots == ()
    assert not st.degraded() and svc.group("world").requests["admit"] == []
    op = _ok(svc, SUP, GetOperation("grow", id=4))["operation"]
    assert op["phase"] == "timed_out" and [r["state"] for r in op["ranks"]] == [
        "joining", "joining"]
    assert _ok(svc, SUP, Scale(5, id=5))["slots"] == [4]  # a new grow may start


def test_a_waiting_grow_replaced_by_a_later_operation_reads_superseded():
    """A grow 4 -> 6 still waiting for its joiners, then the target lowered back to 4:
    the grow's operation used to read waiting_for_joiners forever; it is superseded."""
    svc = _growable(4, 6, scale_timeout_s=30.0)
    _ok(svc, SUP, Scale(6, operation_id="grow", id=3))
    assert _ok(svc, SUP, GetOperation("grow", id=4))["operation"]["phase"] == \
        "waiting_for_joiners"
    _ok(svc, SUP, Scale(4, operation_id="back", id=5))
    assert _status(svc).ep_size == 4
    assert _ok(svc, SUP, GetOperation("grow", id=6))["operation"]["phase"] == "superseded"
    assert _ok(svc, SUP, GetOperation("back", id=7))["operation"]["phase"] == "done"


# ---- the HTTP routes over the real service ---------------------------------------------
class ServiceMembership:
    """A ``MembershipSource`` that hands each call to a :class:`MembershipService` (no
    sockets): the front-end's routes meet the coordinator's real decisions."""

    def __init__(self, svc: MembershipService) -> None:
        self.svc = svc

    def _call(self, msg: Message) -> dict:
        from elasticep.membership.client import _REFUSALS, MembershipRequestError

        reply = [s.msg for s in self.svc.handle(SUP, msg) if isinstance(s.msg, Reply)][-1]
        if not reply.ok:
            raise _REFUSALS.get(reply.code, MembershipRequestError)(reply.error)
        return reply.body

    def status(self) -> DeploymentStatus:
        return DeploymentStatus.from_dict(self._call(GetDeploymentStatus(id=1))["status"])

    def scale(self, new_ep_size: int, operation_id: str | None = None) -> dict:
        return self._call(Scale(new_ep_size, operation_id, id=1))

    def retire(self, ranks=None, node=None, operation_id=None, keep_processes=False) -> dict:
        return self._call(Retire(ranks, node, operation_id, keep_processes, id=1))

    def operation(self, operation_id: str) -> dict:
        return self._call(GetOperation(operation_id, id=1))["operation"]


@contextlib.contextmanager
def scale_routes(svc: MembershipService) -> Iterator[tuple[Any, Any]]:
    """The HTTP server (started) and its front-end over ``svc`` (tiny model, no ranks)."""
    from elasticep.frontend.http_server import create_server
    from elasticep.frontend_link import FrontendChannel

    channel = FrontendChannel()
    model = DEMO_MODEL
    server, frontend = create_server(model, channel, ServiceMembership(svc),
                                     served_model_name="tiny")
    frontend.coordinator_address = "10.0.0.1:29500"
    server.start()
    try:
        yield server, frontend
    finally:
        server.stop()
        channel.close()


def test_scale_routes_answer_operations_refusals_and_the_join_a_grow_needs():
    import httpx

    svc = _growable(3, 4, min_holding=2)
    with scale_routes(svc) as (server, _frontend):
        url = server.url + "/scale_elastic_ep"
        r = httpx.post(url, json={"retire_ranks": [0, 1]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "scale_refused"
        r = httpx.post(url, json={"drain_node": 0})
        assert r.status_code == 409 and "no healthy rank" in r.json()["error"]["message"]
        r = httpx.post(url, json={"retire_ranks": [3]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "retire_ranks"
        assert httpx.get(url + "/op-1").status_code == 404
        r = httpx.post(url, json={"new_ep_size": 2, "keep_processes": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_processes"
        r = httpx.post(url, json={"new_ep_size": 4, "operation_id": "g"})
        assert r.status_code == 200, r.text
        join = ("elasticep join --dist-init-addr 10.0.0.1:29500 --elastic-ep-join-mode scale "
                "--ranks 3")
        assert r.json() == {"status": "accepted", "new_ep_size": 4, "old_ep_size": 3,
                            "slots": [3], "scale_phase": "waiting_for_joiners",
                            "operation_id": "g", "waiting_for_joiners": {
                                "slots": [3], "join_command": join}}
        health = httpx.get(server.url + "/health").json()
        assert health["waiting_for_joiners"] == {"slots": [3], "join_command": join}
        assert httpx.get(server.url + "/elastic_ep_status").json()["waiting_slots"] == [3]
        r = httpx.post(url, json={"new_ep_size": 3, "operation_id": "g"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "operation_conflict"
        r = httpx.post(url, json={"retire_ranks": [2]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "scale_in_progress"
        op = httpx.get(url + "/g").json()
        assert op == {"operation_id": "g", "request": {"new_ep_size": 4},
                      "phase": "waiting_for_joiners",
                      "ranks": [{"rank": 3, "state": "joining"}]}


def test_a_rank_with_no_recorded_launch_is_on_no_node():
    """A new leader knows a rank's node only from a launch recorded with it: until then
    the status shows no node (not node 0, where node 0's launcher would match the
    rank's pid against its own processes) and draining node 0 does not pick it."""
    svc = _deployment(2, {0: 0})  # rank 1 registered, its launch never recorded
    ranks = {r.rank: r.node for r in _status(svc).ranks}
    assert ranks == {0: 0, 1: None}
    assert _refused(svc, Retire(node=1, id=10)).error.endswith("runs no rank of the deployment")
