"""The chaos kinds of the 2-node etcd deployment (`leader-kill`, `node-0-host-kill`): how
schedules draw them, the command line that asks for them, and the invariant readers
over several nodes' logs. Pure: no deployment.

The run itself (two `serve` nodes and a 3-member etcd): `python -m
elasticep_testkit.chaos --trials 2 --seed 0 --nnodes 2` draws one of each kind; CI runs
it in ``tests/test_chaos_two_nodes.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticep_testkit.chaos import invariants
from elasticep_testkit.chaos.__main__ import parse_args
from elasticep_testkit.chaos.schedule import ALL_KINDS, HOST_KINDS, KINDS, Schedule, make_schedule


def test_host_kinds_are_drawn_only_on_two_nodes():
    two = [make_schedule(0, t, 4, 2.0, HOST_KINDS, nnodes=2) for t in range(40)]
    faults = [f for s in two for f in s.faults]
    assert {f.kind for f in faults} == set(HOST_KINDS)
    assert {f.ranks for f in faults if f.kind == "node-0-host-kill"} == {(0, 1)}
    assert {f.ranks for f in faults if f.kind == "leader-kill"} == {()}
    assert all([f.kind for f in s.faults].count("node-0-host-kill") <= 1 for s in two)
    assert all(Schedule.parse(s.describe()) == s for s in two)
    # the documented reproducer: seed 0 draws the host kill, then the leader kill
    assert [make_schedule(0, t, 4, 2.0, HOST_KINDS, nnodes=2).faults[0].kind
            for t in range(2)] == ["node-0-host-kill", "leader-kill"]
    one = {f.kind for t in range(40) for f in make_schedule(1, t, 4, 2.0, ALL_KINDS).faults}
    assert one and one <= set(KINDS)  # a single node has no etcd and no second host
    # 8 ranks on two nodes: node 0 holds 0-3, a host kill takes them all
    eight = [f for t in range(20)
             for f in make_schedule(3, t, 8, 2.0, HOST_KINDS, nnodes=2).faults]
    assert {f.ranks for f in eight if f.kind == "node-0-host-kill"} == {(0, 1, 2, 3)}


def test_the_command_line_pairs_kinds_with_nodes(capsys):
    assert parse_args(["--nnodes", "2"]).kinds == HOST_KINDS
    assert parse_args([]).kinds == KINDS and parse_args([]).nnodes == 1
    for argv, says in ((["--kinds", "leader-kill"], "not drawn with --nnodes 1"),
                       (["--nnodes", "2", "--kinds", "kill"], "not drawn with --nnodes 2"),
                       (["--schedule", "node-0-host-kill:ranks=0+1:at=1:p=0"],
                        "cannot run with --nnodes 1"),
                       (["--nnodes", "2", "--ep-size", "5"], "multiple of --nnodes")):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2 and says in capsys.readouterr().err, argv


COMMIT = ("{t} elasticep.membership: INFO coordinator: group world commit epoch {e} "
          "{{'kind': <TransitionKind.FAILURE: 'failure'>, 'epoch': {e}, 'active': {a}, "
          "'dead': []}}\n")
VIEW = ("{t} rank={r} epoch={e} elasticep.elastic.step_loop: INFO placement reconciled in "
        "0.010s: 0 checkpoint reloads, 0 copied from departed ranks' memory, 0 peer copies, "
        "8 slots per rank, active {a}; no step pending\n")


def test_the_readers_take_every_nodes_logs(tmp_path: Path):
    node0, node1 = tmp_path / "node0-0", tmp_path / "node1"
    node0.mkdir(), node1.mkdir()
    # node 0's leader logged epoch 3 and died before the store had it; node 1's replica
    # then led and committed epoch 3 over other ranks: the later line is the commit
    (node0 / "serve.log").write_text(
        COMMIT.format(t="2026-12-06 10:00:01,000", e=2, a=[0, 1, 2, 3])
        + COMMIT.format(t="2026-12-06 10:00:02,000", e=3, a=[0, 1, 2]))
    (node1 / "serve.log").write_text(COMMIT.format(t="2026-12-06 10:00:05,500", e=3, a=[2, 3]))
    logs = [node0 / "serve.log", node1 / "serve.log"]
    assert invariants.coordinator_commits(*logs) == {2: (0, 1, 2, 3), 3: (2, 3)}
    assert invariants.coordinator_commits(*reversed(logs)) == {2: (0, 1, 2, 3), 3: (2, 3)}
    (node0 / "rank0.log").write_text(VIEW.format(t="2026-12-06 10:00:01,100", r=0, e=2,
                                                 a=[0, 1, 2, 3]))
    (node1 / "rank2.log").write_text(VIEW.format(t="2026-12-06 10:00:05,600", r=2, e=3,
                                                 a=[2, 3]))
    views = invariants.worker_views(node0, node1)
    assert views == {2: {0: {(0, 1, 2, 3)}}, 3: {2: {(2, 3)}}}
    assert invariants.check_membership(views, invariants.coordinator_commits(*logs),
                                       range(1, 4)) == []
    # a rank of node 1 that applied the dead leader's epoch 3 is caught
    (node1 / "rank3.log").write_text(VIEW.format(t="2026-12-06 10:00:02,100", r=3, e=3,
                                                 a=[0, 1, 2]))
    bad = invariants.check_membership(invariants.worker_views(node0, node1),
                                      invariants.coordinator_commits(*logs), range(1, 4))
    assert bad and "epoch 3: ranks disagree" in bad[0]
