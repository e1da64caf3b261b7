"""The restart policy of serve and join (`deploy/restart_policy.py`) without processes:
one look at the node in, the actions out."""

import pytest

from elasticep.deploy.launcher import RankExit
from elasticep.deploy.restart_policy import (
    Action,
    End,
    Ledger,
    OnExit,
    Policy,
    Until,
    View,
    World,
    decide,
    ending,
    on_exit_for,
    restart_budget,
)
from elasticep.membership.transitions import SlotState

RELAUNCH = Policy(OnExit.RELAUNCH)


def _view(states: dict[int, str] | None, coord_pids=None, running=None, ours=None,
          nodes=None, node: int = 0) -> View:
    """A node-``node`` look; ``states`` None: the coordinator does not answer."""
    world = None if states is None else World(
        7, {r: SlotState(s) for r, s in states.items()}, coord_pids or {},
        nodes if nodes is not None else dict.fromkeys(states, 0))
    running = running or {}
    return View(node, "127.0.0.1:29400", world, ours if ours is not None else running,
                running)


def _kinds(actions: list[Action]) -> list[tuple[str, int]]:
    return [(a.kind.value, a.rank) for a in actions]


def test_a_crash_is_relaunched_a_removal_and_a_free_slot_are_not():
    view = _view({0: "healthy", 1: "failed", 2: "free", 3: "free"}, running={0: 10})
    exits = [RankExit(1, 11, -9), RankExit(2, 12, 1), RankExit(3, 13, 0)]
    actions, ledger = decide(view, exits, RELAUNCH, Ledger())
    assert _kinds(actions) == [("relaunch", 1)]
    assert ledger.restarts == {1: (0.0,)} and ledger.deferred == ()
    # without --restart-failed-ranks: only logged
    assert decide(view, exits, Policy(OnExit.LOG), Ledger())[0] == []


def test_the_restart_budget_is_per_rank():
    view = _view({1: "failed"})
    actions, ledger = decide(view, [RankExit(1, 11, -9)], Policy(OnExit.RELAUNCH,
                             max_restarts=2), Ledger({1: (0.0, 0.0)}))
    assert actions == [] and ledger.restarts == {1: (0.0, 0.0)} and ledger.waiting == (1,)


def test_without_fault_tolerance_the_first_exit_stops_everything():
    actions, _ = decide(_view({0: "healthy", 1: "failed"}),
                        [RankExit(1, 11, -9), RankExit(0, 10, -9)], Policy(OnExit.STOP),
                        Ledger())
    assert _kinds(actions) == [("stop", 1)]
    assert on_exit_for(False, fault_tolerant=False) == OnExit.STOP
    with pytest.raises(ValueError):
        on_exit_for(True, fault_tolerant=False)


def test_exits_during_an_outage_wait_for_the_coordinator():
    policy = Policy(OnExit.RELAUNCH, Until.ALL_EXITED, coordinator_timeout_s=30)
    actions, ledger = decide(_view(None), [RankExit(2, 12, 3), RankExit(3, 13, 0)], policy,
                             Ledger())
    assert actions == [] and ledger.deferred == (2,)  # the removed one is not kept
    assert ending(policy, ledger, idle=lambda: True, unreachable_for_s=10) is None
    assert ending(policy, ledger, idle=lambda: True, unreachable_for_s=31) == End.GIVE_UP
    assert ending(policy, ledger, idle=lambda: False, unreachable_for_s=31) is None
    actions, ledger = decide(_view({2: "failed", 3: "free"}), [], policy, ledger)
    assert _kinds(actions) == [("relaunch", 2)] and actions[0].why == "lost the coordinator"
    assert ledger.deferred == ()
    assert ending(policy, ledger, idle=lambda: True, unreachable_for_s=None) == End.DONE
    assert ending(Policy(OnExit.RELAUNCH), ledger, idle=lambda: True, unreachable_for_s=None) is None


def test_a_frozen_evicted_worker_is_killed_and_not_adopted():
    view = _view({0: "healthy", 1: "failed"}, coord_pids={0: 10, 1: 11},
                 running={0: 10, 1: 11})
    actions, _ = decide(view, [], RELAUNCH, Ledger())
    assert _kinds(actions) == [("kill", 1)]


def test_a_failed_rank_another_launcher_started_is_adopted():
    def look(coord_pid: int, node: int = 0, policy: Policy = RELAUNCH):
        view = _view({0: "healthy", 1: "failed"}, coord_pids={0: 10, 1: coord_pid},
                     running={0: 10}, ours={0: 10, 1: 11}, nodes={0: 0, 1: node})
        return _kinds(decide(view, [], policy, Ledger())[0])

    assert look(77) == [("relaunch", 1)]       # a join's pid: relaunched here
    assert look(11) == []                      # our own: its exit decides
    assert look(77, node=1) == []              # another node's rank
    assert look(77, policy=Policy(OnExit.LOG)) == []
    # relaunched for its exit in this look: not adopted a second time
    view = _view({1: "failed"}, coord_pids={1: 77}, ours={1: 11})
    actions, ledger = decide(view, [RankExit(1, 11, -9)], RELAUNCH, Ledger())
    assert _kinds(actions) == [("relaunch", 1)] and ledger.restarts == {1: (0.0,)}


def test_the_restart_budget_is_a_rate():
    """--max-restarts 2 --restart-window 100: a third crash within 100 s waits until the
    oldest relaunch leaves the window, then the rank is relaunched; crashes far apart are
    always relaunched (the old budget of 5 for serve's lifetime never reset)."""
    policy = Policy(OnExit.RELAUNCH, max_restarts=2, restart_window_s=100.0)

    def look(now: float, ledger: Ledger, exits=()) -> tuple[list, Ledger]:
        view = View(0, "127.0.0.1:29400", World(7, {1: SlotState.FAILED}, {1: 11}, {1: 0}),
                    {1: 11}, {}, now)
        return decide(view, list(exits), policy, ledger)

    crash = [RankExit(1, 11, -9)]
    actions, ledger = look(0.0, Ledger(), crash)
    actions2, ledger = look(10.0, ledger, crash)
    assert _kinds(actions + actions2) == [("relaunch", 1), ("relaunch", 1)]
    actions, ledger = look(20.0, ledger, crash)  # third within the window: it waits
    assert actions == [] and ledger.waiting == (1,)
    assert restart_budget(policy, ledger, 20.0) == {
        "max_restarts": 2, "restart_window_s": 100.0, "enabled": True, "rejoin_lost": False,
        "recent_restarts": {"1": 2}, "waiting_for_budget": [1]}
    actions, ledger = look(99.0, ledger)
    assert actions == []
    actions, ledger = look(100.5, ledger)  # the relaunch at 0 s left the window
    assert _kinds(actions) == [("relaunch", 1)] and ledger.waiting == ()
    assert ledger.restarts == {1: (10.0, 100.5)}
    for t in (1000.0, 2000.0, 3000.0):  # a crash a while: always relaunched
        actions, ledger = look(t, ledger, crash)
        assert _kinds(actions) == [("relaunch", 1)]


def test_an_exit_after_admission_is_never_called_one_before_it(caplog, capsys):
    """`join scale` logged "exited with -9 before it was admitted" for a rank that had
    been healthy; and it never said when its loaded ranks were admitted."""
    import logging

    from elasticep.entrypoints.join_cmd import AdmissionReport

    report = AdmissionReport([4, 5])
    healthy = _view({4: "healthy", 5: "ready"}, coord_pids={4: 14, 5: 15},
                    running={4: 14, 5: 15})
    _, ledger = decide(healthy, [], Policy(OnExit.LOG), Ledger())
    assert ledger.admitted == {4: 14}
    report(ledger, 0.0)
    report(ledger, 0.1)  # once
    assert capsys.readouterr().out == "admitted: ranks [4] are members (healthy)\n"
    gone = _view({4: "free", 5: "free"}, coord_pids={4: 14, 5: 15})
    with caplog.at_level(logging.INFO, logger="elasticep.deploy.supervisor"):
        _, ledger = decide(gone, [RankExit(4, 14, -9), RankExit(5, 15, -9)],
                           Policy(OnExit.LOG), ledger)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "epoch 7: rank 4 (pid 14) exited with -9 after it left the deployment; its slot is "
        "free capacity again",
        "epoch 7: rank 5 (pid 15) exited with -9 before it was admitted; its slot is free "
        "capacity again"]
    assert ledger.admitted == {}


def test_with_standby_coordinators_a_rank_the_membership_failed_rejoins_its_slot():
    """Without --restart-failed-ranks, under etcd (``rejoin_lost``): an exit with 3 (the
    membership failed the rank while it lived: its node was cut off) is relaunched in
    recover mode, within the budget; a crash is still only logged. One that exits while
    no coordinator answers waits for one, with no time limit (quorum comes back when
    the partition heals); the embedded default is unchanged."""
    policy = Policy(OnExit.LOG, Until.ALL_EXITED, max_restarts=1, coordinator_timeout_s=30,
                    rejoin_lost=True)
    view = _view({0: "failed", 1: "failed"})
    actions, ledger = decide(view, [RankExit(0, 10, 3), RankExit(1, 11, 1)], policy, Ledger())
    assert _kinds(actions) == [("relaunch", 0)] and "membership" in actions[0].why
    assert decide(view, [RankExit(0, 10, 3)], Policy(OnExit.LOG), Ledger())[0] == []
    # over the budget: it waits for it, as a relaunched crash does
    actions, ledger = decide(view, [RankExit(0, 12, 3)], policy, ledger)
    assert actions == [] and ledger.waiting == (0,)
    assert restart_budget(policy, ledger, 0.0)["rejoin_lost"] is True
    # the exit seen while the node is cut off: relaunched once a coordinator answers
    actions, ledger = decide(_view(None), [RankExit(1, 13, 3)], policy, Ledger())
    assert actions == [] and ledger.deferred == (1,)
    assert ending(policy, ledger, idle=lambda: True, unreachable_for_s=3600) is None
    actions, ledger = decide(_view({1: "failed"}), [], policy, ledger)
    assert _kinds(actions) == [("relaunch", 1)] and ledger.deferred == ()
