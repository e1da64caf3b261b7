"""Pure membership decisions: transitions, resume points, donors, local actions."""

import pytest

from elasticep.membership.messages import (
    ControlMessage,
    Deactivate,
    EpochReport,
    RankHello,
    Ready,
    Register,
    Reply,
    RequestDeactivation,
    SupervisorHello,
)
from elasticep.membership.registry import Group, Transition
from elasticep.membership.service import MembershipService, SendOnConn
from elasticep.membership.transitions import (
    OnFailure,
    Report,
    SlotState,
    decide,
    local_action,
    next_slot_state,
)


def test_failure_all_at_same_op_pivots():
    d = decide("failure", 1, {0, 1, 3}, {2}, {s: Report(9, 10) for s in (0, 1, 3)})
    assert (d.resume, d.last, d.boundary, d.base) == (10, 9, 10, 11)
    assert local_action(d, 10, True, True, "complete") == "run"
    assert local_action(d, 10, True, True, "raise") == "raise"
    assert local_action(d, 10, False, False, "complete") == "raise"  # all_to_all


def test_failure_one_survivor_completed_commit_op_is_fetched():
    reports = {0: Report(10, 10, frozenset({9, 10})), 1: Report(9, 10, frozenset({9}))}
    d = decide("failure", 2, {0, 1}, {2}, reports)
    assert (d.resume, d.last, d.donors) == (10, 10, {10: 0})
    # the rank still in op 10 takes rank 0's result, even in raise mode
    assert local_action(d, 10, True, True, "raise") == "fetch"
    # op 11 is the pivot for everyone
    assert local_action(d, 11, True, True, "raise") == "raise"
    assert d.base == 12


def test_failure_after_unfetchable_op_raises_everywhere():
    reports = {0: Report(10, 11), 1: Report(9, 10)}  # op 10 was an all_to_all
    d = decide("failure", 2, {0, 1}, {3}, reports)
    assert not d.fetchable
    assert local_action(d, 10, False, False, "complete") == "raise"
    assert local_action(d, 11, True, True, "complete") == "raise"
    assert d.base == 12


def test_change_boundary_after_ops_in_flight():
    d = decide("change", 3, {0, 1, 2}, set(), {0: Report(4, 5), 1: Report(5, 5)})
    assert d.boundary == 6 and d.kind == "change"


def test_transition_defers_admission_behind_failure():
    g = Group.create("w", [0, 1, 2, 3], [0, 1, 2], OnFailure.COMPLETE, set())
    g.states[3] = "ready"
    g.pending_admit = {3}
    tr = Transition.begin(g)
    assert tr.kind == "change" and tr.new_active == {0, 1, 2, 3}
    g.pending_dead.add(1)
    tr = tr.restart(g)
    assert tr.kind == "failure" and tr.new_active == {0, 2} and g.pending_admit == {3}
    g.commit(tr)
    assert g.active == {0, 2}
    tr2 = Transition.begin(g)
    assert tr2.kind == "change" and tr2.new_active == {0, 2, 3}


def test_late_removal_vote_does_not_undo_a_later_readmission():
    # scale-down of slot 4: one member's deactivate call lands while the removal runs
    g = Group.create("w", [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], OnFailure.COMPLETE, set())
    g.pending_remove = {4}
    tr = Transition.begin(g)
    assert tr.kind == "change" and tr.new_active == {0, 1, 2, 3}
    g.pending_remove.add(4)  # the late member's vote
    g.commit(tr)
    assert g.states[4] == "free" and not g.pending_remove
    # a new joiner for slot 4 is admitted, and nothing removes it again
    g.states[4] = "ready"
    g.pending_admit = {4}
    tr = Transition.begin(g)
    assert tr.new_active == {0, 1, 2, 3, 4}
    g.pending_admit.add(4)  # a late recover_ranks vote
    g.commit(tr)
    assert g.states[4] == "healthy"
    assert Transition.begin(g) is None


def test_joiner_for_active_slot_is_refused():
    with pytest.raises(ValueError):
        next_slot_state("healthy", "joining")
    assert next_slot_state("failed", "joining") == "joining"


SUP = 100  # the connection id of the supervisor in these tests (ranks use their rank)


def _ok(svc: MembershipService, conn: int, msg: ControlMessage) -> list[SendOnConn]:
    """Hand ``msg`` to the service as if it came on ``conn``; fail on any refusal."""
    sends = svc.handle(conn, msg)
    refused = [s.msg for s in sends if isinstance(s.msg, Reply) and not s.msg.ok]
    assert not refused, refused
    return sends


def _service(n: int, active: list[int] | None = None):
    """A membership service (no sockets, no threads) whose ``n`` ranks said hello and
    registered WORLD (slots ``active`` active, the others joiners), plus a supervisor."""
    active = list(range(n)) if active is None else active
    svc = MembershipService(store_port=1, clock=lambda: 0.0)
    for r in range(n):
        ext = r not in active
        _ok(svc, r, RankHello(rank=r, pid=100 + r, world_size=n, max_world_size=n,
                              is_extension=ext, id=1))
        _ok(svc, r, Register("world", list(range(n)), active, OnFailure.COMPLETE, ext, id=2))
    _ok(svc, SUP, SupervisorHello(id=1))
    return svc, svc.group("world")


def _report_all(svc, g) -> None:
    epoch = g.transition.epoch
    for s in sorted(g.transition.waiting):
        _ok(svc, s, EpochReport("world", epoch, 5, 5, []))


@pytest.mark.parametrize("mid_removal", [False, True])
def test_rank_dying_while_draining_ends_removed(mid_removal):
    """Scale-down 6 -> 4 and rank 5 dies while draining: slot 5 ends removed (not failed),
    it leaves the active set through a failure decision, and slot 4's removal still runs."""
    c, g = _service(6)
    _ok(c, SUP, RequestDeactivation("world", [4, 5], id=3))
    assert g.states[4:] == ["draining", "draining"]
    if mid_removal:  # the members already started the removal transition
        _ok(c, 0, Deactivate("world", [4, 5], id=3))
        assert g.transition.kind == "change"
    c.closed(5)
    assert g.states[5] == "free"
    assert g.transition.kind == "failure" and g.transition.dead == {5}
    assert 5 not in g.pending_remove and g.requests["remove"] == [4]
    _report_all(c, g)
    assert g.active == {0, 1, 2, 3, 4}
    if g.transition is None:  # the members vote slot 4's removal again
        _ok(c, 0, Deactivate("world", [4], id=4))
    assert g.transition.kind == "change" and g.transition.removed == {4}
    _report_all(c, g)
    assert g.active == {0, 1, 2, 3} and g.transition is None
    assert g.states == ["healthy"] * 4 + ["free", "free"]
    assert not g.pending_remove and g.requests["remove"] == []


def test_a_removed_rank_leaving_is_info_and_a_death_is_a_warning(caplog):
    """Scale-down 6 -> 4: ranks 4 and 5 exit after their removal (INFO, not WARNING);
    rank 2 dying is a failure (WARNING)."""
    import logging

    from elasticep.deploy.launcher import exit_log_level

    c, g = _service(6)
    _ok(c, SUP, RequestDeactivation("world", [4, 5], id=3))
    _ok(c, 0, Deactivate("world", [4, 5], id=3))
    _report_all(c, g)
    assert g.states == ["healthy"] * 4 + ["free", "free"]
    with caplog.at_level(logging.INFO, logger="elasticep.membership"):
        c.closed(4)
        c.closed(2)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "pid" in r.getMessage()]
    assert lines == [
        ("INFO", "coordinator: rank 4 (pid 104) left after its planned removal: "
                 "control connection closed"),
        ("WARNING", "coordinator: rank 2 (pid 102) dead: control connection closed")]
    assert g.states[4] == "free" and g.states[2] == "failed"
    # serve's launcher: the worker's exit status 0 after a removal is INFO too
    assert (exit_log_level(0), exit_log_level(1), exit_log_level(-9)) == (
        logging.INFO, logging.WARNING, logging.WARNING)


def test_a_healthy_scale_down_is_not_degraded():
    """/health said degraded while 6 -> 4 drained healthy ranks 4 and 5."""
    from elasticep.membership.status import DeploymentStatus, RankStatus
    from elasticep.membership.transitions import ScalePhase

    def status(*states: str, ep_size: int = 4, phase=ScalePhase.DRAINING):
        return DeploymentStatus(3, ep_size, 6, phase, tuple(
            RankStatus(r, SlotState(s)) for r, s in enumerate(states)))

    assert not status(*["healthy"] * 4, "draining", "draining").degraded()
    assert not status(*["healthy"] * 4, "free", "free", phase=ScalePhase.IDLE).degraded()
    assert status("healthy", "failed", "healthy", "healthy", "draining", "draining").degraded()
    # a scale-up is degraded until its joiners are in (the target counts them)
    assert status(*["healthy"] * 4, "ready", "joining", ep_size=6,
                  phase=ScalePhase.ADMITTING).degraded()
    assert status(*["healthy"] * 4, "free", "free", ep_size=6,
                  phase=ScalePhase.WAITING_FOR_JOINERS).degraded()


def test_healthy_rank_dying_is_failed():
    c, g = _service(4)
    c.closed(2)
    assert g.states[2] == "failed" and g.transition.dead == {2}


@pytest.mark.parametrize("loaded", ["joining", "ready"])
@pytest.mark.parametrize("admission_asked", [False, True])
def test_scale_joiner_dying_before_admission_gives_its_slot_back(loaded, admission_asked):
    """serve --ep-size 4 --max-ep-size 5, join scale --ranks 4, kill -9 it once registered
    (or ready), with or without POST 5 first: slot 4 is free capacity again, no failure
    epoch, not degraded, and a new scale joiner may take it."""
    from elasticep.membership.scaling import ScaleTarget, check_join
    from elasticep.membership.status import DeploymentStatus, RankStatus
    from elasticep.membership.transitions import state_after_death

    c, g = _service(5, active=[0, 1, 2, 3])  # rank 4 registered as a joiner
    assert g.states[4] == SlotState.JOINING
    if loaded == "ready":
        _ok(c, 4, Ready("world", id=3))
        assert g.states[4] == SlotState.READY
    if admission_asked:
        g.pending_admit.add(4)
    c.closed(4)
    assert g.states == ["healthy"] * 4 + ["free"]
    assert g.transition is None and not g.pending_dead and not g.pending_admit
    # not degraded (with POST 5 first, the scale waits for a joiner: no slot has failed)
    status = DeploymentStatus(g.epoch, 4, 5, ranks=tuple(
        RankStatus(r, st) for r, st in enumerate(g.states)))
    assert not status.degraded()
    check_join("scale", [4], g.states, g.ranks, ScaleTarget(4, 5), {}, {})  # no refusal
    # a recover joiner that dies gives back a failed slot: still failed, as before
    assert state_after_death(SlotState.JOINING, False, False, SlotState.FAILED) == "failed"
    # an admitted member (or one the transition in flight admits) that dies has failed
    assert state_after_death(SlotState.READY, False, True, SlotState.FREE) == "failed"


def test_every_request_type_has_one_handler_and_its_role():
    """The service's handlers name the request they answer (no table of names): the 18
    request types, rank requests only from ranks, launch records only from supervisors."""
    from elasticep.membership import messages as m
    from elasticep.membership.handlers import Role, handler_table

    table = handler_table(MembershipService(store_port=1))
    requests = {t for t in m.message_types() if t not in (
        m.RankHello, m.SupervisorHello, m.Heartbeat, m.Reply, m.HeartbeatAck, m.Announce,
        m.Commit, m.Peer, m.Evicted)}
    assert set(table) == requests and len(table) == 20
    assert {t for t, (_h, role) in table.items() if role == Role.RANK} == {
        m.Register, m.Ready, m.Recover, m.Deactivate, m.EpochReport, m.Ping}
    assert {t for t, (_h, role) in table.items() if role == Role.SUPERVISOR} == {
        m.RecordLaunch, m.ClearLaunch, m.Reserve, m.Release}
    c, _g = _service(2)
    sends = c.handle(SUP, Register("world", [0, 1], [0, 1], OnFailure.COMPLETE, False, id=9))
    assert [(s.conn, s.msg.ok, s.msg.code) for s in sends] == [(SUP, False, "malformed")]


def test_a_removed_rank_waits_for_its_own_copy_of_the_removal():
    # A step header carries the first member's copy of the requests; the removed rank
    # reads whether to stay up (keep_processes) from its own copy, which may lag: it
    # waits until that copy has the removal (requested, with keep, or committed).
    from elasticep.distributed.api import removal_known
    assert not removal_known({"admit": [], "remove": []}, (0, 1, 2), 2)  # not pushed yet
    assert removal_known({"admit": [], "remove": [2]}, (0, 1, 2), 2)
    assert removal_known({"admit": [], "remove": [], "keep": [2]}, (0, 1, 2), 2)  # committed
    assert removal_known({"admit": [], "remove": []}, (0, 1), 2)  # committed, not kept
    assert not removal_known({"admit": [], "remove": [1], "keep": [1]}, (0, 1, 2), 2)
