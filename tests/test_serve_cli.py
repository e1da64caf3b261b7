"""`serve` / `join` flag handling and the coordinator-backed membership, without workers."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import elasticep
from elasticep.config import JoinMode
from elasticep.distributed.gloo_device import gloo_devices
from elasticep.entrypoints.cli import build_parser
from elasticep.entrypoints.join_cmd import JoinError, parse_mode_and_ranks
from elasticep.entrypoints.serve_args import validate
from elasticep.entrypoints.validate import UsageError
from elasticep.membership.errors import JoinRefusedError, ScaleInProgressError
from elasticep.membership.scaling import (
    Launch,
    ProcInfo,
    ScaleTarget,
    check_join,
    deployment_status,
)
from elasticep.membership.status import DeploymentStatus, RankStatus
from elasticep.membership.transitions import OnFailure, SlotState, scale_phase
from elasticep.utils.wait import wait_until

pytestmark = pytest.mark.timeout(60)


def _serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def _join(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["join", "--dist-init-addr", "127.0.0.1:1", *argv])


@pytest.mark.parametrize("argv, words", [
    (["--ep-size", "4", "--max-ep-size", "2"], "--max-ep-size"),
    (["--nnodes", "2", "--node-rank", "2", "--ep-size", "4", "--dist-init-addr", "h:1"],
     "--node-rank"),
    (["--ep-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "multiple of --nnodes"),
    (["--nnodes", "2", "--ep-size", "2"], "--dist-init-addr"),
    (["--nnodes", "0"], "--nnodes must be >= 1"),
    (["--model", "/nonexistent/model"], "no such model directory"),
    (["--dist-init-addr", "nohost"], "HOST:PORT"),
    (["--dist-init-addr", "127.0.0.1:99999"], "--dist-init-addr 99999 is not a TCP port"),
    (["--dist-init-addr", ":29400"], "HOST:PORT"),
    (["--dist-init-addr", "tcp://10.0.0.1:29400"], "must be HOST:PORT .no scheme or path."),
    (["--nnodes", "2", "--node-rank", "1", "--ep-size", "2", "--dist-init-addr", "h:0"],
     "--dist-init-addr 0 is not a TCP port"),
    (["--port", "70000"], "--port 70000 is not a TCP port"),
    (["--elastic-ep-backend", "none", "--ep-size", "2", "--max-ep-size", "3"], "cannot scale"),
    (["--gloo-socket-ifname", "nosuchif0"], "--gloo-socket-ifname: no network interface "
                                            "'nosuchif0'"),
    (["--heartbeat-timeout", "inf"], "--heartbeat-timeout must be a finite"),
    (["--heartbeat-timeout", "nan"], "--heartbeat-timeout must be a finite"),
    (["--log-stats-interval", "inf"], "--log-stats-interval must be a finite"),
    (["--log-stats-interval", "-1"], "--log-stats-interval must be a finite"),
    (["--gc-warning-threshold-secs", "inf"], "--gc-warning-threshold-secs must be a finite"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in .0, 1., got 1.5"),
    (["--max-running-requests", "0"], "--max-running-requests must be in .1, 65536., got 0"),
    (["--max-running-requests", "100000"],
     "--max-running-requests must be in .1, 65536., got 100000"),
    (["--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs must be >= 1, got 0"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be >= 1, or -1 .off., got 0"),
    (["--api-server-count", "0"], "--api-server-count must be in .1, 64., got 0"),
    (["--api-server-count", "1000"], "--api-server-count must be in .1, 64., got 1000"),
    (["--api-server-count", "2", "--elastic-ep-backend", "none"],
     "--api-server-count > 1 needs --elastic-ep-backend elastic"),
    (["--api-server-count", "2", "--nnodes", "2", "--node-rank", "1", "--ep-size", "2",
      "--dist-init-addr", "h:1"], "--api-server-count > 1 applies to a node that serves"),
])
def test_bad_serve_flags_name_the_flag(argv, words):
    with pytest.raises(UsageError, match=words.replace("-", r"\-")):
        validate(_serve(*argv))


def test_gloo_socket_ifname_reaches_the_ranks_environment(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    validate(_serve("--gloo-socket-ifname", "lo"))
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"  # launched workers inherit it
    assert len(gloo_devices("10.9.9.9")) == 1  # the interface wins over the address


def test_unsupported_family_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UsageError, match="unsupported model family 'llama'"):
        validate(_serve("--model", str(tmp_path)))


def test_valid_flags_build_the_deployment_and_warn_on_open_host():
    s = validate(_serve("--ep-size", "4", "--max-ep-size", "6", "--ep-num-redundant-experts",
                        "16", "--host", "0.0.0.0", "--nnodes", "2", "--node-rank", "1",
                        "--dist-init-addr", "10.0.0.1:29400"))
    assert (s.deployment.ep_size, s.deployment.max_ep_size) == (4, 6)
    assert s.deployment.ep_num_redundant_experts == 16
    assert s.local_ranks == [2, 3]
    assert (s.coordinator_host, s.coordinator_port) == ("10.0.0.1", 29400)
    assert any("--api-key" in w for w in s.warnings)


def test_a_cuda_graph_max_bs_above_max_running_requests_is_lowered_with_a_warning(capsys):
    from elasticep.engine.limits import rank_limits
    from elasticep.entrypoints.deployment_args import deployment_config

    s = validate(_serve("--max-running-requests", "8", "--cuda-graph-max-bs", "32"))
    assert (s.deployment.max_running_requests, s.deployment.cuda_graph_max_bs) == (8, 8)
    [warning] = s.warnings
    assert warning.startswith("--cuda-graph-max-bs 32 is above --max-running-requests 8")
    assert rank_limits(s.deployment, None).cuda_graph_max_bs == 8
    for argv in (["--max-running-requests", "8", "--cuda-graph-max-bs", "8"],
                 ["--cuda-graph-max-bs", "512"], ["--max-running-requests", "8"]):
        assert validate(_serve(*argv)).warnings == (), argv
    assert validate(_serve("--cuda-graph-max-bs", "512")).deployment.cuda_graph_max_bs == 512
    # generate has no warnings list: the line goes to stderr
    args = build_parser().parse_args(["generate", "--prompt", "x", "--max-running-requests",
                                      "4", "--cuda-graph-max-bs", "16"])
    assert deployment_config(args).cuda_graph_max_bs == 4
    assert "warning: --cuda-graph-max-bs 16 is above --max-running-requests 4" in (
        capsys.readouterr().err)


def _group_of(command: str, flag: str) -> argparse._ArgumentGroup:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(g for g in sub.choices[command]._action_groups
                if any(flag in a.option_strings for a in g._group_actions))


def test_help_groups_and_texts():
    for command in ("serve", "generate"):
        assert _group_of(command, "--log-stats-interval").title == "logging and metrics"
        assert _group_of(command, "--heartbeat-timeout").title == "fault tolerance"
    payload = next(a for a in _group_of("serve", "--max-payload-size")._group_actions
                   if "--max-payload-size" in a.option_strings)
    assert payload.help.endswith("(default: 33554432 = 32 MiB)"), payload.help
    for flag, words in (("--max-tokens", "tokens to generate"), ("--top-p", "nucleus"),
                        ("--top-k", "K most likely")):
        action = next(a for a in _group_of("generate", flag)._group_actions
                      if flag in a.option_strings)
        assert action.help and words in action.help, (flag, action.help)


def test_bad_flags_exit_2_with_one_line_and_no_traceback():
    p = subprocess.run([sys.executable, "-m", "elasticep.entrypoints.cli", "serve",
                        "--ep-size", "4", "--max-ep-size", "3"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == ["elasticep serve: error: --max-ep-size (3) must be >= --ep-size (4)"]


@pytest.mark.parametrize("command, argv, line", [
    ("serve", ["--dist-init-addr", "127.0.0.1:99999"],
     "elasticep serve: error: --dist-init-addr 99999 is not a TCP port (must be in [0, 65535])"),
    ("serve", ["--port", "70000"],
     "elasticep serve: error: --port 70000 is not a TCP port (must be in [0, 65535])"),
    ("serve", ["--api-server-count", "-1"],
     "elasticep serve: error: --api-server-count must be in [1, 64], got -1"),
    ("join", ["--dist-init-addr", "127.0.0.1:99999", "--elastic-ep-rejoin", "--ranks", "1"],
     "elasticep join: error: --dist-init-addr 99999 is not a TCP port (must be in [1, 65535])"),
    # a URL used to pass as host "http://127.0.0.1" and be tried for 60 s
    ("join", ["--dist-init-addr", "http://127.0.0.1:29400", "--elastic-ep-rejoin", "--ranks",
              "1"], "elasticep join: error: --dist-init-addr must be HOST:PORT (no scheme or "
                    "path), got 'http://127.0.0.1:29400'"),
])
def test_every_address_flag_gets_the_same_one_line_check(command, argv, line):
    p = subprocess.run([sys.executable, "-m", "elasticep.entrypoints.cli", command, *argv],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert [ln for ln in p.stderr.splitlines() if ln.strip()] == [line]


@pytest.mark.parametrize("command, argv", [
    ("serve", ["--ep-size", "2"]),
    ("join", ["--dist-init-addr", "127.0.0.1:1", "--elastic-ep-rejoin", "--ranks", "1"]),
])
def test_a_log_dir_that_cannot_be_made_is_a_flag_error_before_anything_starts(tmp_path,
                                                                              command, argv):
    """It used to surface after the coordinator started (serve: "cannot start the
    coordinator ... No such file or directory", exit 1) or after the join had reserved
    its slot."""
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "logs"
    p = subprocess.run([sys.executable, "-m", "elasticep.entrypoints.cli", command, *argv,
                        "--log-dir", str(bad)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert [ln for ln in p.stderr.splitlines() if ln.strip()] == [
        f"elasticep {command}: error: --log-dir {bad}: cannot create it (Not a directory)"]


@pytest.mark.parametrize("argv, expected", [
    (["--elastic-ep-join-mode", "recover", "--ranks", "2"], ("recover", [2])),
    (["--elastic-ep-rejoin", "--ranks", "0"], ("recover", [0])),
    (["--elastic-ep-join-mode", "scale", "--ranks", "4,5"], ("scale", [4, 5])),
    (["--elastic-ep-join-mode", "scale", "--elastic-ep-join-rank-offset", "4", "--nranks", "2"],
     ("scale", [4, 5])),
])
def test_join_ranks(argv, expected):
    mode, ranks = parse_mode_and_ranks(_join(*argv))
    assert (mode, ranks) == expected and type(mode) is JoinMode


@pytest.mark.parametrize("argv", [
    ["--ranks", "2"],
    ["--elastic-ep-rejoin", "--elastic-ep-join-mode", "scale", "--ranks", "2"],
    ["--elastic-ep-join-mode", "scale", "--ranks", "4", "--nranks", "2"],
    ["--elastic-ep-join-mode", "scale", "--ranks", "4,x"],
    ["--elastic-ep-join-mode", "scale", "--ranks", "4,4"],
])
def test_join_bad_flags(argv):
    with pytest.raises(JoinError):
        parse_mode_and_ranks(_join(*argv))


def _states(*names: str) -> list[SlotState]:
    return [SlotState(n) for n in names]


def _procs(pids: dict[int, int], in_world: bool = True) -> dict[int, ProcInfo]:
    return {r: ProcInfo(p, True, in_world) for r, p in pids.items()}


def _check(mode, want, states, pids=None, ep_size=None, launched=None, procs=None):
    states = _states(*states)
    target = ScaleTarget(len(states) if ep_size is None else ep_size, len(states))
    launches = {r: Launch(0, p) for r, p in (launched or {}).items()}
    check_join(mode, want, states, list(range(len(states))), target,
               procs if procs is not None else _procs(pids or {}), launches)


def test_join_refuses_occupied_or_wrong_mode_slots():
    states = ["healthy", "failed", "healthy", "healthy", "free", "free"]
    _check("recover", [1], states, {0: 11})
    _check("scale", [4, 5], states, {0: 11})
    with pytest.raises(JoinRefusedError, match="rank 0 is healthy \\(pid 11\\)"):
        _check("recover", [0], states, {0: 11})
    with pytest.raises(JoinRefusedError, match="use --elastic-ep-join-mode scale"):
        _check("recover", [4], states, {0: 11})
    with pytest.raises(JoinRefusedError, match="--elastic-ep-join-mode recover"):
        _check("scale", [1], states, {0: 11})
    with pytest.raises(JoinRefusedError, match="outside the capacity"):
        _check("scale", [6], states, {0: 11})


def test_scale_phase():
    s = ["healthy"] * 4 + ["joining", "ready"]
    assert scale_phase(s, {4, 5}, set()) == "waiting_for_joiners"
    assert scale_phase(["healthy"] * 4 + ["ready", "ready"], {4, 5}, set()) == "admitting"
    assert scale_phase(["healthy"] * 6, {4, 5}, set()) == "idle"
    assert scale_phase(["healthy"] * 5 + ["draining"], set(), {5}) == "draining"
    assert scale_phase(["healthy"] * 5 + ["free"], set(), {5}) == "idle"
    assert scale_phase(["failed"] + ["healthy"] * 3, set(), set()) == "idle"


def _view(states, procs, launched=None, ep_size=4, max_ep_size=None, nodes=None):
    states = None if states is None else _states(*states)
    cap = max_ep_size or len(states)
    launches = {r: Launch(0, p) for r, p in (launched or {}).items()}
    return deployment_status(3, states, list(range(cap)), ScaleTarget(ep_size, cap), procs,
                             launches, nodes or {}).to_dict()


def test_status_shape():
    procs = _procs({0: 10, 1: 11, 2: 12, 3: 13})
    st = _view(["healthy", "failed", "healthy", "healthy", "free", "free"], procs,
               nodes={r: r // 2 for r in range(6)})
    assert st["epoch"] == 3 and st["ep_size"] == 4 and st["max_ep_size"] == 6
    assert st["ranks"][1] == {"rank": 1, "state": "failed", "pid": 11, "node": 0}
    assert st["ranks"][5] == {"rank": 5, "state": "free", "pid": None, "node": 2}
    empty = _view(None, {}, ep_size=2, max_ep_size=3)
    assert [r["state"] for r in empty["ranks"]] == ["joining", "joining", "free"]
    assert DeploymentStatus.from_dict(st).to_dict() == st


def test_status_shows_loading_workers_as_joining():
    """Workers load before they register: a launched, unregistered worker is joining."""
    procs = _procs({0: 10, 1: 11, 2: 12})  # rank 3 has not registered yet
    st = _view(["healthy", "failed", "healthy", "healthy", "free", "free"], procs,
               launched={1: 21, 3: 13, 4: 24, 0: 10})
    assert [(r["state"], r["pid"]) for r in st["ranks"]] == [
        ("healthy", 10), ("joining", 21), ("healthy", 12), ("joining", 13), ("joining", 24),
        ("free", None)]


def test_status_registered_joiner_stays_joining():
    """The window between a joiner's process registration and its group registration:
    the slot is still "failed" but its (new, alive) process is known: joining, not failed.
    A dead registered process in a failed slot stays failed."""
    procs = {0: ProcInfo(10, True, True), 1: ProcInfo(21, True, False),
             2: ProcInfo(12, False, True), 3: ProcInfo(13, True, True)}
    # rank 3: a member being scaled away (still alive, still in the group) stays removed
    st = _view(["healthy", "failed", "failed", "free"], procs,
               launched={0: 10, 1: 21, 3: 13})
    assert [(r["state"], r["pid"]) for r in st["ranks"]] == [
        ("healthy", 10), ("joining", 21), ("failed", 12), ("free", 13)]


def test_a_slot_freed_by_a_scale_down_shows_no_pid_once_its_process_exited():
    """`/elastic_ep_status` showed {"state": "free", "pid": 22899} long after 22899 exited
    (README: `kill -9 <pid>` kills exactly that rank; that pid may be reused)."""
    procs = {0: ProcInfo(10, True, True), 1: ProcInfo(11, False, True),
             2: ProcInfo(12, False, True), 3: ProcInfo(13, True, True)}
    st = _view(["healthy", "failed", "free", "free"], procs, ep_size=2)
    assert [(r["state"], r["pid"]) for r in st["ranks"]] == [
        ("healthy", 10), ("failed", 11), ("free", None), ("free", 13)]
    # its launcher has not recorded the exit yet (a kept worker that just stopped):
    # still free, not joining (a CI run saw "joining" for that moment)
    st = _view(["healthy", "failed", "free", "free"], procs, ep_size=2,
               launched={0: 10, 2: 12, 3: 13})
    assert [(r["state"], r["pid"]) for r in st["ranks"]] == [
        ("healthy", 10), ("failed", 11), ("free", None), ("free", 13)]


def test_scale_up_down_and_409():
    t = ScaleTarget(4, 6)
    plan = t.plan(6, _states(*["healthy"] * 4, "free", "free"))
    assert plan.admit == (4, 5) and plan.remove == () and plan.reply["slots"] == [4, 5]
    joining = _states(*["healthy"] * 4, "free", "free")
    assert t.phase(joining) == "waiting_for_joiners"
    with pytest.raises(ScaleInProgressError):
        t.plan(3, joining)  # below the size before the grow: not a withdrawal
    assert t.phase(_states(*["healthy"] * 4, "ready", "ready")) == "admitting"
    assert t.phase(_states(*["healthy"] * 6)) == "idle" and t.ep_size == 6
    plan = t.plan(4, _states(*["healthy"] * 6))
    assert plan.remove == (4, 5) and plan.reply == {"old_ep_size": 6, "slots": [4, 5],
                                                    "scale_phase": "draining"}
    assert t.phase(_states(*["healthy"] * 4, "draining", "draining")) == "draining"
    assert t.phase(_states(*["healthy"] * 4, "free", "free")) == "idle"
    assert t.ep_size == 4
    with pytest.raises(ValueError):
        t.plan(7, _states(*["healthy"] * 4, "free", "free"))
    # serve's shrink: slots [K, max) leave, whatever their order of admission
    t = ScaleTarget(6, 6)
    assert t.plan(2, _states("healthy", "healthy", "failed", *["healthy"] * 3)).remove == (
        3, 4, 5)
    assert t.ep_size == 2


def test_pending_grow_can_be_lowered():
    """4 -> 6 waits for joiners; joiner 5 died: a scale to 5 withdraws slot 5 only."""
    t = ScaleTarget(4, 6)
    states = _states(*["healthy"] * 4, "joining", "failed")
    t.plan(6, states)
    assert t.phase(states) == "waiting_for_joiners"
    plan = t.plan(5, states)
    assert plan.remove == (5,) and plan.reply == {
        "old_ep_size": 6, "slots": [5], "scale_phase": "waiting_for_joiners"}
    assert t.ep_size == 5
    assert t.phase(_states(*["healthy"] * 5, "failed")) == "idle" and t.ep_size == 5
    # an admitted slot is not withdrawn: that is a scale-down, after the grow
    t = ScaleTarget(4, 6)
    t.plan(6, _states(*["healthy"] * 4, "joining", "joining"))
    with pytest.raises(ScaleInProgressError, match="already admitted"):
        t.plan(4, _states(*["healthy"] * 5, "joining"))
    assert t.ep_size == 6


def _status(states: dict[int, str], pids: dict[int, int], epoch: int = 5) -> DeploymentStatus:
    # every rank launched on node 0, the fake launchers' node
    return DeploymentStatus(epoch, len(states), len(states), ranks=tuple(
        RankStatus(r, SlotState(st), pids.get(r), 0) for r, st in sorted(states.items())))


class FakeLauncher:
    """What `supervise` uses of a Deployment, with a scripted coordinator view."""

    node = 0
    address = "127.0.0.1:29400"

    def __init__(self, states: dict[int, str], pids: dict[int, int]) -> None:
        import queue
        import threading

        self.exits: queue.Queue = queue.Queue()
        self.stop = threading.Event()  # set at the third look at the coordinator
        self.polls = 0
        self.states, self.live = states, pids
        self.spawned: list[tuple[int, str | None]] = []
        self.admitted: list[list[int]] = []
        self.killed: list[int] = []

    def deployment_status(self) -> DeploymentStatus:
        self.polls += 1
        if self.polls == 3:  # two whole supervise iterations are done
            self.stop.set()
        return _status(self.states, self.live)

    def pids(self, live_only: bool = False) -> dict[int, int]:
        return dict(self.live)

    def relaunch(self, *ranks: int) -> list[int]:
        self.spawned += [(r, "recover") for r in ranks]
        self.admitted.append(list(ranks))
        return [1000 + r for r in ranks]

    def kill(self, rank: int) -> None:
        self.killed.append(rank)
        self.live.pop(rank)


def _supervise_once(launcher, restart: bool) -> list:
    """Two supervise iterations (the queued exits are drained in the first); returns
    the exits it saw, so a test knows the supervisor reached them."""
    from elasticep.deploy.restart_policy import Policy, on_exit_for
    from elasticep.deploy.supervisor import supervise

    seen = supervise(launcher, launcher.stop, Policy(on_exit_for(restart)), poll_s=0.001)
    assert launcher.polls == 3
    return seen


def test_restart_policy_relaunches_crashes_only():
    from elasticep.deploy import RankExit

    launcher = FakeLauncher({0: "healthy", 1: "failed", 2: "healthy", 3: "free"},
                            {0: 10, 2: 12})
    launcher.exits.put(RankExit(1, 11, -9))  # crashed: relaunched and admitted
    launcher.exits.put(RankExit(3, 13, 0))   # removed on purpose: never relaunched
    seen = _supervise_once(launcher, restart=True)
    assert seen == [RankExit(1, 11, -9), RankExit(3, 13, 0)]
    assert launcher.spawned == [(1, "recover")] and launcher.admitted == [[1]]

    launcher = FakeLauncher({0: "healthy", 1: "failed"}, {0: 10})
    launcher.exits.put(RankExit(1, 11, -9))
    seen = _supervise_once(launcher, restart=False)  # without the flag: only logged
    assert seen == [RankExit(1, 11, -9)] and launcher.spawned == []


class PartitionedLauncher(FakeLauncher):
    """A node whose coordinator is unreachable for its first ``down_polls`` looks (a
    partition), then answers again (or never, with ``down_polls=None``)."""

    def __init__(self, states: dict[int, str], pids: dict[int, int],
                 down_polls: int | None) -> None:
        super().__init__(states, pids)
        self.down_polls = down_polls

    def deployment_status(self) -> DeploymentStatus:
        self.polls += 1
        if self.down_polls is None or self.polls <= self.down_polls:
            raise ConnectionError("coordinator connection closed or timed out")
        if self.spawned:  # relaunched: the node is whole again
            self.stop.set()
        return _status(self.states, self.live)

    def watching(self) -> bool:
        return bool(self.live)


def test_ranks_lost_to_a_partition_are_relaunched_when_the_coordinator_answers():
    from elasticep.deploy import RankExit
    from elasticep.deploy.restart_policy import OnExit, Policy, Until
    from elasticep.deploy.supervisor import supervise

    launcher = PartitionedLauncher({0: "healthy", 1: "healthy", 2: "failed", 3: "failed"},
                                   {}, down_polls=5)
    launcher.node = 1
    launcher.exits.put(RankExit(2, 12, 3))  # both stopped on the lost coordinator
    launcher.exits.put(RankExit(3, 13, 3))
    seen = supervise(launcher, launcher.stop, Policy(OnExit.RELAUNCH, Until.ALL_EXITED,
                                                     coordinator_timeout_s=30), poll_s=0.001)
    assert [ex.rank for ex in seen] == [2, 3]
    assert launcher.spawned == [(2, "recover"), (3, "recover")]  # once it answered
    assert launcher.polls == 6

    # without --restart-failed-ranks nothing is relaunched: the node returns at once
    launcher = PartitionedLauncher({2: "failed"}, {}, down_polls=5)
    launcher.exits.put(RankExit(2, 12, 3))
    supervise(launcher, launcher.stop, Policy(OnExit.LOG, Until.ALL_EXITED), poll_s=0.001)
    assert launcher.spawned == [] and launcher.polls == 1


def test_a_node_gives_up_on_a_coordinator_that_stays_unreachable():
    from elasticep.deploy import RankExit
    from elasticep.deploy.restart_policy import OnExit, Policy, Until
    from elasticep.deploy.supervisor import CoordinatorUnreachableError, supervise

    launcher = PartitionedLauncher({2: "failed"}, {}, down_polls=None)
    launcher.exits.put(RankExit(2, 12, 3))
    with pytest.raises(CoordinatorUnreachableError, match=r"no coordinator answered at "
                       r"--dist-init-addr 127.0.0.1:29400 within 0.2 s"):
        supervise(launcher, launcher.stop, Policy(OnExit.RELAUNCH, Until.ALL_EXITED,
                                                  coordinator_timeout_s=0.2), poll_s=0.01)
    assert launcher.spawned == []


def test_relaunch_hint_is_a_command_that_runs(caplog):
    from elasticep.deploy import RankExit

    launcher = FakeLauncher({0: "healthy", 1: "healthy", 2: "failed"}, {0: 10, 1: 11})
    launcher.node = 1
    launcher.exits.put(RankExit(2, 12, -9))
    with caplog.at_level("WARNING", logger="elasticep.deploy.supervisor"):
        _supervise_once(launcher, restart=False)
    hints = re.findall(r"relaunch it with `(elasticep join [^`]+)`", caplog.text)
    assert len(hints) == 1
    args = build_parser().parse_args(shlex.split(hints[0])[1:])  # as the shell would
    assert args.dist_init_addr == "127.0.0.1:29400" and args.node_rank == 1
    assert parse_mode_and_ranks(args) == ("recover", [2])


def test_a_scale_joiner_never_admitted_gets_no_recover_hint(caplog):
    from elasticep.deploy import RankExit

    # slot 4's joiner died before admission: the coordinator gave the slot back (free)
    launcher = FakeLauncher({0: "healthy", 1: "healthy", 4: "free"}, {0: 10, 1: 11})
    launcher.exits.put(RankExit(4, 14, 3))
    with caplog.at_level("INFO", logger="elasticep.deploy.supervisor"):
        _supervise_once(launcher, restart=False)
    assert "relaunch it with" not in caplog.text
    assert "rank 4 (pid 14) exited with 3 before it was admitted; its slot is free" in \
        caplog.text


def test_exit_status_follows_the_usual_conventions():
    import os
    import signal

    from elasticep.deploy import RankExit
    from elasticep.deploy.supervisor import StopEvent, exit_status, stop_on_signals

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        stop = stop_on_signals()
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        assert stop.wait(5) and stop.exit_status() == 130
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    assert exit_status(1, 1, [], stop) == 130
    calm = StopEvent()
    assert exit_status(2, 2, [RankExit(4, 40, -9)], calm) == 1  # join's rank SIGKILLed
    assert exit_status(2, 2, [RankExit(4, 40, 3)], stop) == 1   # lost the coordinator
    assert exit_status(2, 1, [], calm) == 1                     # one died before joining
    assert exit_status(2, 2, [RankExit(4, 40, 0), RankExit(5, 50, 0)], calm) == 0  # removed


class JoinedLauncher(FakeLauncher):
    """Rank 1 of this node was relaunched by a `join` (pid 77), then died: the
    coordinator shows it failed with the join's pid; this launcher only ever started
    pid 11 for it."""

    def __init__(self, coordinator_pid: int) -> None:
        super().__init__({0: "healthy", 1: "failed"}, {0: 10})
        self.coordinator_pid = coordinator_pid

    def deployment_status(self) -> DeploymentStatus:
        super().deployment_status()  # counts the polls that end _supervise_once
        pids = {**self.live, 1: self.live.get(1, self.coordinator_pid)}
        return _status(self.states, pids)

    def pids(self, live_only: bool = False) -> dict[int, int]:
        return dict(self.live) if live_only else {1: 11, **self.live}

    def relaunch(self, *ranks: int) -> list[int]:
        for r in ranks:
            self.states[r], self.live[r] = "joining", 1000 + r
        return super().relaunch(*ranks)


def test_restart_policy_relaunches_a_rank_a_join_started():
    launcher = JoinedLauncher(coordinator_pid=77)
    _supervise_once(launcher, restart=True)
    assert launcher.spawned == [(1, "recover")]
    launcher = JoinedLauncher(coordinator_pid=77)
    _supervise_once(launcher, restart=False)  # without the flag: nothing
    assert launcher.spawned == []
    launcher = JoinedLauncher(coordinator_pid=11)  # our own rank: its exit decides
    _supervise_once(launcher, restart=True)
    assert launcher.spawned == []


def test_restart_policy_kills_an_evicted_frozen_worker():
    launcher = FakeLauncher({0: "healthy", 1: "failed"}, {0: 10, 1: 11})
    _supervise_once(launcher, restart=True)
    assert launcher.killed == [1]


def test_join_refuses_slots_being_joined_or_outside_ep_size():
    states = ["healthy", "failed", "joining", "ready", "failed", "free"]
    procs = _procs({0: 10, 1: 11, 2: 12, 3: 13, 4: 14})
    procs[1] = ProcInfo(11, False, True)
    # failed, but serve --restart-failed-ranks (or another join) already started pid 21
    with pytest.raises(JoinRefusedError, match=r"^rank 1 is already being joined \(pid 21\)$"):
        _check("recover", [1], states, ep_size=6, launched={1: 21}, procs=procs)
    _check("recover", [1], states, ep_size=6, procs=procs)  # nothing loading: free
    for r, pid in ((2, 12), (3, 13)):
        with pytest.raises(JoinRefusedError,
                           match=rf"rank {r} is already being joined \(pid {pid}\)"):
            _check("recover", [r], states, ep_size=6, procs=procs)
    # a scale-down to 4 left slot 4 failed: recover must not bring it back
    with pytest.raises(JoinRefusedError, match=r"^rank 4 is outside ep_size 4; use "
                                               r"--elastic-ep-join-mode scale$"):
        _check("recover", [4], states, ep_size=4, procs=procs)
    _check("recover", [4], states, ep_size=6, procs=procs)
    _check("scale", [5], states, ep_size=4, procs=procs)


@pytest.fixture
def coordinator():
    from elasticep.config import DeploymentConfig
    from elasticep.deploy import publish_config
    from elasticep.membership import start_coordinator

    coord = start_coordinator()
    publish_config(coord.address, DeploymentConfig(model="demo", ep_size=4, max_ep_size=6))
    yield coord
    coord.close()


def _with_world(coord, states: list[str]) -> None:
    """Give the coordinator a WORLD group in these slot states (no worker processes)."""
    from elasticep.membership.registry import Group

    g = Group("world", list(range(len(states))), _states(*states), OnFailure.COMPLETE)
    g.active = {s for s, st in enumerate(states) if st == "healthy"}
    with coord._lock:
        coord.service._groups["world"] = g  # no worker processes to register it


def test_shrink_frees_failed_slots_above_the_target(coordinator):
    """6 -> 4 while slot 4 is failed: slot 4 is free capacity (not failed), the
    deployment is not degraded, and growing again takes it with `join scale`."""
    from elasticep.membership import CoordinatorClient

    _with_world(coordinator, ["healthy"] * 6)
    c = CoordinatorClient(coordinator.address)
    try:
        c.scale(6)
        assert c.deployment_status().scale_phase == "idle"
        _with_world(coordinator, ["healthy"] * 4 + ["failed", "healthy"])
        assert c.scale(4)["slots"] == [5]  # slot 5 drains; slot 4 had nothing to drain
        st = c.deployment_status()
        assert [r.state for r in st.ranks][4] == "free"
        with pytest.raises(JoinRefusedError, match="outside ep_size 4"):
            c.reserve([4], "recover")
        assert c.reserve([4], "scale") == 4
    finally:
        c.close()


def test_join_reservation_is_exclusive_and_released(coordinator):
    """Claims are the coordinator's, per connection: exclusive, all or none, gone with
    the connection that held them (a `join` that died leaves nothing behind)."""
    from elasticep.membership import CoordinatorClient

    _with_world(coordinator, ["healthy", "healthy", "failed", "failed", "free", "free"])
    a, b = CoordinatorClient(coordinator.address), CoordinatorClient(coordinator.address)
    assert a.reserve([2, 3], "recover") == 4
    with pytest.raises(JoinRefusedError, match=r"^rank 3 is already being joined "
                                               r"\(elasticep join pid \d+ on .+\)$"):
        b.reserve([4, 3], "recover")
    b.reserve([4], "scale")  # the refused attempt claimed nothing
    with pytest.raises(JoinRefusedError, match="rank 5 is outside ep_size 4"):
        b.reserve([5], "recover")  # a refused check claims nothing
    a.close()  # its owner is gone: the claims go with its connection
    wait_until(lambda: b.reserve([2, 3], "recover") == 4, 5.0, "the claims released",
               retry_on=(JoinRefusedError,))
    b.release()
    c = CoordinatorClient(coordinator.address)
    c.reserve([4, 5], "scale")  # b released all; the refused check had claimed nothing
    for cl in (b, c):
        cl.close()


def test_scale_through_the_coordinator(coordinator):
    """The target lives in the coordinator: a scale there is what `join` checks against."""
    from elasticep.membership import CoordinatorClient

    _with_world(coordinator, ["healthy"] * 4 + ["free", "free"])
    c = CoordinatorClient(coordinator.address)
    try:
        assert c.deployment_status().ep_size == 4
        assert c.scale(6) == {"old_ep_size": 4, "slots": [4, 5],
                              "scale_phase": "waiting_for_joiners", "operation_id": "op-1"}
        st = c.deployment_status()
        assert st.ep_size == 6 and st.scale_phase == "waiting_for_joiners"
        with pytest.raises(ScaleInProgressError):
            c.scale(3)
        with pytest.raises(ValueError, match=r"must be in \[1, 6\], got 9"):
            c.scale(9)
        assert c.scale(4)["slots"] == [4, 5]  # the pending grow is withdrawn
        _with_world(coordinator, ["healthy", "failed", "healthy", "healthy", "free",
                                  "free"])
        assert c.reserve([1], "recover") == 4
        c.scale(2)  # slot 1 is failed and below the new target; 2 and 3 leave
        assert c.deployment_status().ep_size == 2
        c.release()
        with pytest.raises(JoinRefusedError, match="outside ep_size 2"):
            c.reserve([3], "recover")
    finally:
        c.close()


def test_join_success_needs_our_own_worker():
    from elasticep.entrypoints.join_cmd import exit_reason, joined_ranks

    st = _status({0: "healthy", 1: "healthy"}, {0: 10655, 1: 11})
    goal = (SlotState.HEALTHY,)
    assert not joined_ranks(st, [0], {0: 777}, goal)  # another process's success
    assert joined_ranks(st, [0], {0: 10655}, goal)
    assert not joined_ranks(st, [0], {}, goal)
    tail = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
            "ValueError: slot 0 is already held by live pid 10655\n")
    assert exit_reason(tail) == "ValueError: slot 0 is already held by live pid 10655"
    assert exit_reason("loading\nkilled\n") == "killed"
    assert exit_reason("") == ""


def test_join_cli_refuses_a_slot_another_join_holds(capsys, coordinator):
    """Two `join`s of one slot: the second is refused (exit 2, one line) before launching."""
    from elasticep.entrypoints import join_cmd
    from elasticep.membership import CoordinatorClient

    args = build_parser().parse_args(["join", "--dist-init-addr", coordinator.address,
                                      "--elastic-ep-join-mode", "recover", "--ranks", "2"])
    assert join_cmd.run(args) == 2  # no ranks registered yet
    assert capsys.readouterr().err.strip().splitlines() == [
        "elasticep join: error: the deployment has no ranks yet; wait for serve's ready line"]
    _with_world(coordinator, ["healthy", "healthy", "failed", "healthy", "free", "free"])
    other = CoordinatorClient(coordinator.address)
    other.reserve([2], "recover")
    assert join_cmd.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "elasticep join: error: rank 2 is already being joined (elasticep join pid ")
    other.close()


class _JoinLauncher:
    """What `_report_progress` uses of RankLauncher: exits, status, pids, logs."""

    log_dir = None

    def __init__(self, states: list[str], pids: dict[int, int]) -> None:
        import queue

        self.exits: queue.Queue = queue.Queue()
        self.states, self._pids = states, pids

    def deployment_status(self) -> DeploymentStatus:
        return _status(dict(enumerate(self.states)), self._pids)

    def pids(self, live_only: bool = True) -> dict[int, int]:
        return dict(self._pids)

    def log_tail(self, rank: int, lines: int = 40) -> str:
        return "loading\nRuntimeError: out of memory\n"


def test_join_progress_keeps_the_other_joiners_when_one_dies(capsys):
    """scale --ranks 4,5: joiner 5 dies while loading; joiner 4 still gets to ready."""
    import threading

    from elasticep.deploy import RankExit
    from elasticep.entrypoints.join_cmd import _report_progress

    launcher = _JoinLauncher(["healthy"] * 4 + ["ready", "failed"], {0: 1, 4: 104, 5: 105})
    launcher.exits.put(RankExit(5, 105, -9))
    assert _report_progress(launcher, "scale", [4, 5], threading.Event()) == [4]
    captured = capsys.readouterr()
    assert "rank 5 exited with -9 before it joined: RuntimeError: out of memory" in captured.err
    # rank 4 was ready already: not "still joining" (it printed that before)
    assert captured.err.rstrip().endswith("out of memory; rank 4 is ready"), captured.err
    assert "still joining" not in captured.err
    assert captured.out.startswith("ready: ranks [4] loaded")
    launcher.exits.put(RankExit(5, 105, -9))  # 4 still loading: it is still joining
    launcher.states = ["healthy"] * 4 + ["joining", "failed"]
    threading.Timer(0.5, lambda: launcher.states.__setitem__(4, "ready")).start()
    assert _report_progress(launcher, "scale", [4, 5], threading.Event()) == [4]
    assert "out of memory; still joining: ranks [4]" in capsys.readouterr().err
    launcher.exits.put(RankExit(4, 104, 1))  # every rank dies first: nothing got in
    launcher.states = ["healthy"] * 4 + ["failed", "failed"]
    assert _report_progress(launcher, "scale", [4], threading.Event()) == []


def test_unknown_flag_prints_the_subcommand_usage_and_version_exists():
    p = subprocess.run([sys.executable, "-m", "elasticep.entrypoints.cli", "serve", "--prot"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.startswith("usage: elasticep serve ")
    assert p.stderr.rstrip().endswith("elasticep serve: error: unrecognized arguments: --prot")
    v = subprocess.run([sys.executable, "-m", "elasticep.entrypoints.cli", "--version"],
                       capture_output=True, text=True, timeout=60)
    assert (v.returncode, v.stdout.strip()) == (0, f"elasticep {elasticep.__version__}")


def test_join_help_says_what_ctrl_c_does_and_the_exit_flags_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["join", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("Ctrl-C (or SIGTERM) hands the ranks that are already members over to the "
            "deployment: they keep serving") in text
    assert "--detach return once the ranks are members (healthy)" in text
    assert "--stop-ranks-on-exit Ctrl-C / SIGTERM stop every rank this join started" in text
    assert _join("--ranks", "2", "--elastic-ep-rejoin", "--detach").detach
    with pytest.raises(SystemExit) as done:
        _join("--ranks", "2", "--elastic-ep-rejoin", "--detach", "--stop-ranks-on-exit")
    assert done.value.code == 2
    assert "not allowed with argument --detach" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_model_help_names_every_supported_family(command):
    """serve's --model help named three of the five families README lists."""
    from elasticep.models.config import SUPPORTED_FAMILIES

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    model = next(a for a in sub.choices[command]._actions if "--model" in a.option_strings)
    assert f"({', '.join(SUPPORTED_FAMILIES)})" in model.help
    assert len(SUPPORTED_FAMILIES) == 5


def test_serving_doc_flag_table_lists_every_serve_flag():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "SERVING.md").read_text()
    section = doc.split("## `elasticep serve` flags", 1)[1].split("\n#", 1)[0]
    table = {flag for row in section.splitlines() if row.startswith("| `")
             for flag in re.findall(r"`(--[a-z0-9-]+)", row.split(" | ")[0])}  # a2a: digits
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {o for a in sub.choices["serve"]._actions for o in a.option_strings
             if o.startswith("--") and o not in ("--help", "--model-path")}  # alias of --model
    assert flags - table == set()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_port():
    """A real HTTP server (uvicorn, like serve's API) on a free port."""
    import threading

    import uvicorn
    from fastapi import FastAPI

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(FastAPI(), host="127.0.0.1", port=port,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 20, "uvicorn started")
    yield port
    server.should_exit = True
    thread.join(10)


def test_reach_coordinator_names_what_it_reached(coordinator, http_port):
    import time

    from elasticep.deploy.probe import NotACoordinatorError, reach_coordinator

    assert reach_coordinator(coordinator.address, timeout_s=10) is True
    t0 = time.monotonic()
    with pytest.raises(NotACoordinatorError, match=r"^--dist-init-addr 127\.0\.0\.1:\d+ is an "
                       r"HTTP server \(serve's --port\?\), not an ElasticEP coordinator"):
        reach_coordinator(f"127.0.0.1:{http_port}", timeout_s=60)
    assert time.monotonic() - t0 < 15  # named after one handshake, not retried to the end
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"within 1 s \(--coordinator-timeout\)"):
        reach_coordinator(f"127.0.0.1:{_free_port()}", timeout_s=1)
    assert time.monotonic() - t0 < 10


def test_node_with_a_wrong_coordinator_address_exits_within_its_timeout(http_port):
    port = _free_port()
    node = subprocess.run(
        [sys.executable, "-m", "elasticep.entrypoints.cli", "serve", "--nnodes", "2",
         "--node-rank", "1", "--ep-size", "2", "--dist-init-addr", f"127.0.0.1:{port}",
         "--coordinator-timeout", "1"], capture_output=True, text=True, timeout=60)
    assert node.returncode == 1
    assert node.stderr.splitlines()[-1] == (
        f"elasticep serve: error: no coordinator answered at --dist-init-addr 127.0.0.1:{port} "
        "within 1 s (--coordinator-timeout)")
    join = subprocess.run(
        [sys.executable, "-m", "elasticep.entrypoints.cli", "join", "--dist-init-addr",
         f"127.0.0.1:{http_port}", "--elastic-ep-rejoin", "--ranks", "1"],
        capture_output=True, text=True, timeout=60)
    assert join.returncode == 1
    assert join.stderr.splitlines()[-1].startswith(
        f"elasticep join: error: --dist-init-addr 127.0.0.1:{http_port} is an HTTP server")



def test_a_node_run_again_takes_its_failed_or_drained_slots_back_in_place():
    """Node 1 died and its `serve --node-rank 1` was run again (as an orchestrator
    restarts a pod): it was refused and told to use `join ... recover`. Now its failed
    and free slots are taken back in recover mode; slots never held (pid None) start as
    the launch cohort; a slot a live process holds is still refused."""
    from elasticep.entrypoints.serve_node import ranks_in_use, rejoin_ranks

    fresh = DeploymentStatus.from_dict(
        {"epoch": 0, "ep_size": 4, "max_ep_size": 4, "scale_phase": "idle",
         "ranks": [{"rank": r, "state": "healthy", "pid": 10 + r if r < 2 else None,
                    "node": r // 2} for r in range(4)]})
    assert ranks_in_use(fresh, [2, 3], "h:29400", 1) is None
    assert rejoin_ranks(fresh, [2, 3]) == []
    later = DeploymentStatus.from_dict(
        {**fresh.to_dict(), "epoch": 2,
         "ranks": [{"rank": 0, "state": "healthy", "pid": 10, "node": 0},
                   {"rank": 1, "state": "healthy", "pid": 11, "node": 0},
                   {"rank": 2, "state": "failed", "pid": 12, "node": 1},
                   {"rank": 3, "state": "free", "pid": None, "node": 1}]})
    assert ranks_in_use(later, [2, 3], "h:29400", 1) is None
    assert rejoin_ranks(later, [2, 3]) == [2, 3]
    held = DeploymentStatus.from_dict(
        {**later.to_dict(), "ranks": [*later.to_dict()["ranks"][:3],
                                      {"rank": 3, "state": "healthy", "pid": 23, "node": 1}]})
    assert ranks_in_use(held, [2, 3], "h:29400", 1) == (
        "rank 3 is healthy (pid 23) in the running deployment at h:29400; a node's serve "
        "run again takes back only failed or retired slots (stop the process holding them "
        "first)")


def test_a_stalled_startup_names_the_ranks_still_waited_for(tmp_path):
    """A rank frozen while loading blocks start-up (no deadline: loads can be long);
    serve then names it, with its state, pid and where the logs are."""
    from elasticep.entrypoints.serve_cmd import stalled_startup_message
    from elasticep.membership.status import DeploymentStatus

    status = DeploymentStatus.from_dict(
        {"epoch": 0, "ep_size": 3, "max_ep_size": 3, "scale_phase": "idle",
         "ranks": [{"rank": 0, "state": "healthy", "pid": 11, "node": 0},
                   {"rank": 1, "state": "joining", "pid": 12, "node": 0}]})
    line = stalled_startup_message(status, {0}, 3, 61.4, tmp_path)
    assert line == (f"elasticep serve: still waiting after 61 s for ranks 1 (joining, pid 12), "
                    f"2 (not registered yet); their logs are in {tmp_path}")


def test_wait_ready_notes_a_stall_then_returns_once_every_rank_is_routable(monkeypatch, capsys):
    import queue
    import threading
    from types import SimpleNamespace

    from elasticep.entrypoints import serve_cmd
    from elasticep.membership.status import DeploymentStatus

    monkeypatch.setattr(serve_cmd, "STALL_NOTE_S", 0.3)
    polls = [0]

    def status():
        polls[0] += 1
        state = "healthy" if polls[0] > 8 else "joining"  # rank 1 ready after ~0.8 s
        return DeploymentStatus.from_dict(
            {"epoch": 0, "ep_size": 2, "max_ep_size": 2, "scale_phase": "idle",
             "ranks": [{"rank": 0, "state": "healthy", "pid": 11, "node": 0},
                       {"rank": 1, "state": state, "pid": 12, "node": 0}]})

    membership = SimpleNamespace(status=status)
    channel = SimpleNamespace(connected={0: SimpleNamespace(pid=11), 1: SimpleNamespace(pid=12)})
    deployment = SimpleNamespace(exits=queue.Queue(), log_dir=None)
    assert serve_cmd._wait_ready(membership, channel, deployment, 2, threading.Event())
    err = capsys.readouterr().err
    assert "still waiting after 0 s for ranks 1 (joining, pid 12)" in err
