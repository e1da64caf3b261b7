"""`serve` / `join` flag handling and the coordinator-backed membership, without workers."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from elasticep.entrypoints.cli import build_parser
from elasticep.entrypoints.coordinator_membership import (
    CoordinatorMembership,
    scale_phase,
    status_from_snapshot,
)
from elasticep.entrypoints.join_cmd import JoinError, check_slots, parse_mode_and_ranks
from elasticep.entrypoints.membership import ScaleInProgressError
from elasticep.entrypoints.serve_args import UsageError, validate

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
    (["--elastic-ep-backend", "none", "--ep-size", "2", "--max-ep-size", "3"], "cannot scale"),
])
def test_bad_serve_flags_name_the_flag(argv, words):
    with pytest.raises(UsageError, match=words.replace("-", r"\-")):
        validate(_serve(*argv))


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


def test_bad_flags_exit_2_with_one_line_and_no_traceback():
    p = subprocess.run([sys.executable, "-m", "elasticep.entrypoints.cli", "serve",
                        "--ep-size", "4", "--max-ep-size", "3"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == ["elasticep serve: error: --max-ep-size (3) must be >= --ep-size (4)"]


@pytest.mark.parametrize("argv, expected", [
    (["--elastic-ep-join-mode", "recover", "--ranks", "2"], ("recover", [2])),
    (["--elastic-ep-rejoin", "--ranks", "0"], ("recover", [0])),
    (["--elastic-ep-join-mode", "scale", "--ranks", "4,5"], ("scale", [4, 5])),
    (["--elastic-ep-join-mode", "scale", "--elastic-ep-join-rank-offset", "4", "--nranks", "2"],
     ("scale", [4, 5])),
])
def test_join_ranks(argv, expected):
    assert parse_mode_and_ranks(_join(*argv)) == expected


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


def _snapshot(states: list[str], pids: dict[int, int] | None = None, epoch: int = 3) -> dict:
    return {"max_world_size": len(states),
            "ranks": {str(r): {"pid": p, "alive": True} for r, p in (pids or {}).items()},
            "groups": {"world": {"epoch": epoch, "active": [], "states": states,
                                 "ranks": list(range(len(states))), "requests": {}}}}


def test_join_refuses_occupied_or_wrong_mode_slots():
    snap = _snapshot(["healthy", "failed", "healthy", "healthy", "removed", "removed"], {0: 11})
    check_slots("recover", [1], 6, snap)
    check_slots("scale", [4, 5], 6, snap)
    with pytest.raises(JoinError, match="rank 0 is healthy \\(pid 11\\)"):
        check_slots("recover", [0], 6, snap)
    with pytest.raises(JoinError, match="use --elastic-ep-join-mode scale"):
        check_slots("recover", [4], 6, snap)
    with pytest.raises(JoinError, match="--elastic-ep-join-mode recover"):
        check_slots("scale", [1], 6, snap)
    with pytest.raises(JoinError, match="outside the capacity"):
        check_slots("scale", [6], 6, snap)


def test_scale_phase():
    s = ["healthy"] * 4 + ["joining", "ready"]
    assert scale_phase(s, {4, 5}, set()) == "waiting_for_joiners"
    assert scale_phase(["healthy"] * 4 + ["ready", "ready"], {4, 5}, set()) == "admitting"
    assert scale_phase(["healthy"] * 6, {4, 5}, set()) == "idle"
    assert scale_phase(["healthy"] * 5 + ["draining"], set(), {5}) == "draining"
    assert scale_phase(["healthy"] * 5 + ["removed"], set(), {5}) == "idle"
    assert scale_phase(["failed"] + ["healthy"] * 3, set(), set()) == "idle"


def test_status_shape():
    snap = _snapshot(["healthy", "failed", "healthy", "healthy", "removed", "removed"],
                     {0: 10, 1: 11, 2: 12, 3: 13})
    st = status_from_snapshot(snap, 4, 6, "idle", lambda r: r // 2)
    assert st["epoch"] == 3 and st["ep_size"] == 4 and st["max_ep_size"] == 6
    assert st["ranks"][1] == {"rank": 1, "state": "failed", "pid": 11, "node": 0}
    assert st["ranks"][5] == {"rank": 5, "state": "removed", "pid": None, "node": 2}
    empty = status_from_snapshot({"ranks": {}, "groups": {}}, 2, 3, "idle", lambda r: 0)
    assert [r["state"] for r in empty["ranks"]] == ["joining", "joining", "removed"]


def test_status_shows_loading_workers_as_joining():
    """Workers load before they register: a launched, unregistered worker is joining."""
    snap = _snapshot(["healthy", "failed", "healthy", "healthy", "removed", "removed"],
                     {0: 10, 1: 11, 2: 12})  # rank 3 has not registered yet
    launched = {1: 21, 3: 13, 4: 24, 0: 10}.get
    st = status_from_snapshot(snap, 4, 6, "idle", lambda r: 0, launched)
    assert [(r["state"], r["pid"]) for r in st["ranks"]] == [
        ("healthy", 10), ("joining", 21), ("healthy", 12), ("joining", 13), ("joining", 24),
        ("removed", None)]


def test_status_registered_joiner_stays_joining():
    """The window between a joiner's process registration and its group registration:
    the slot is still "failed" but its (new, alive) process is known: joining, not failed.
    A dead registered process in a failed slot stays failed."""
    snap = _snapshot(["healthy", "failed", "failed", "removed"], {0: 10, 1: 21, 2: 12, 3: 13})
    snap["ranks"]["2"]["alive"] = False
    for r in (0, 2, 3):
        snap["ranks"][str(r)]["groups"] = ["world"]
    snap["ranks"]["1"]["groups"] = []
    # rank 3: a member being scaled away (still alive, still in the group) stays removed
    launched = {0: 10, 1: 21, 3: 13}.get
    st = status_from_snapshot(snap, 4, 4, "idle", lambda r: 0, launched)
    assert [(r["state"], r["pid"]) for r in st["ranks"]] == [
        ("healthy", 10), ("joining", 21), ("failed", 12), ("removed", 13)]


class FakeClient:
    """Stands in for CoordinatorClient: a fixed snapshot and the requests it got."""

    def __init__(self, states: list[str]) -> None:
        self.states = states
        self.calls: list[tuple[str, list[int]]] = []

    def status(self) -> dict:
        return _snapshot(self.states)

    def request_admission(self, ranks: list[int]) -> None:
        self.calls.append(("admit", list(ranks)))

    def request_deactivation(self, ranks: list[int]) -> None:
        self.calls.append(("remove", list(ranks)))

    def close(self) -> None:
        pass


def test_membership_scale_up_down_and_409():
    client = FakeClient(["healthy"] * 4 + ["removed"] * 2)
    m = CoordinatorMembership("127.0.0.1:1", 4, 6)
    m._client = client
    assert m.scale(6)["slots"] == [4, 5]
    assert client.calls == [("admit", [4, 5])]
    assert m.status()["scale_phase"] == "waiting_for_joiners"
    with pytest.raises(ScaleInProgressError):
        m.scale(3)  # below the size before the grow: not a withdrawal
    client.states = ["healthy"] * 4 + ["ready"] * 2
    assert m.status()["scale_phase"] == "admitting"
    client.states = ["healthy"] * 6
    assert m.status() | {"ranks": None} == {"epoch": 3, "ep_size": 6, "max_ep_size": 6,
                                             "scale_phase": "idle", "ranks": None}
    m.scale(4)
    assert client.calls[-1] == ("remove", [4, 5])
    client.states = ["healthy"] * 4 + ["draining"] * 2
    assert m.status()["scale_phase"] == "draining"
    client.states = ["healthy"] * 4 + ["removed"] * 2
    assert m.status()["scale_phase"] == "idle" and m.status()["ep_size"] == 4
    with pytest.raises(ValueError):
        m.scale(7)


def test_membership_pending_grow_can_be_lowered():
    """4 -> 6 waits for joiners; joiner 5 died: a scale to 5 withdraws slot 5 only."""
    client = FakeClient(["healthy"] * 4 + ["joining", "failed"])
    m = CoordinatorMembership("127.0.0.1:1", 4, 6)
    m._client = client
    m.scale(6)
    assert m.status()["scale_phase"] == "waiting_for_joiners"
    assert m.scale(5) == {"old_ep_size": 6, "slots": [5], "scale_phase": "waiting_for_joiners"}
    assert client.calls[-1] == ("remove", [5]) and m.ep_size == 5
    client.states = ["healthy"] * 5 + ["failed"]
    assert m.status()["scale_phase"] == "idle" and m.status()["ep_size"] == 5
    # an admitted slot is not withdrawn: that is a scale-down, after the grow
    client = FakeClient(["healthy"] * 4 + ["joining"] * 2)
    m = CoordinatorMembership("127.0.0.1:1", 4, 6)
    m._client = client
    m.scale(6)
    client.states = ["healthy"] * 5 + ["joining"]
    with pytest.raises(ScaleInProgressError, match="already admitted"):
        m.scale(4)
    assert client.calls == [("admit", [4, 5])] and m.ep_size == 6


class FakeLauncher:
    """What `supervise` uses of RankLauncher, with a scripted coordinator view."""

    node = 0

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

    def coordinator_status(self) -> dict:
        self.polls += 1
        if self.polls == 3:  # two whole supervise iterations are done
            self.stop.set()
        return {"ranks": {str(r): {"pid": p, "alive": True} for r, p in self.live.items()},
                "groups": {"world": {"epoch": 5, "ranks": sorted(self.states),
                                     "states": [self.states[r] for r in sorted(self.states)]}}}

    def pids(self) -> dict[int, int]:
        return dict(self.live)

    def spawn(self, rank: int, join_mode: str | None = None) -> int:
        self.spawned.append((rank, join_mode))
        return 1000 + rank

    def request_admission(self, ranks: list[int]) -> None:
        self.admitted.append(ranks)

    def kill(self, rank: int) -> None:
        self.killed.append(rank)
        self.live.pop(rank)


def _supervise_once(launcher, restart: bool) -> list:
    """Two supervise iterations (the queued exits are drained in the first); returns
    the exits it saw, so a test knows the supervisor reached them."""
    from elasticep.entrypoints.supervisor import supervise

    seen = supervise(launcher, launcher.stop, restart=restart, poll_s=0.001)
    assert launcher.polls == 3
    return seen


def test_restart_policy_relaunches_crashes_only():
    from elasticep.entrypoints.launcher import RankExit

    launcher = FakeLauncher({0: "healthy", 1: "failed", 2: "healthy", 3: "removed"},
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


def test_restart_policy_kills_an_evicted_frozen_worker():
    launcher = FakeLauncher({0: "healthy", 1: "failed"}, {0: 10, 1: 11})
    _supervise_once(launcher, restart=True)
    assert launcher.killed == [1]


def test_join_refuses_slots_being_joined_or_outside_ep_size():
    snap = _snapshot(["healthy", "failed", "joining", "ready", "failed", "removed"],
                     {0: 10, 1: 11, 2: 12, 3: 13, 4: 14})
    snap["ranks"]["1"]["alive"] = False
    # failed, but serve --restart-failed-ranks (or another join) already started pid 21
    launched = {1: 21}.get
    with pytest.raises(JoinError, match=r"^rank 1 is already being joined \(pid 21\)$"):
        check_slots("recover", [1], 6, snap, 6, launched)
    check_slots("recover", [1], 6, snap, 6)  # nothing loading: free to recover
    for r, pid in ((2, 12), (3, 13)):
        with pytest.raises(JoinError, match=rf"rank {r} is already being joined \(pid {pid}\)"):
            check_slots("recover", [r], 6, snap, 6)
    # a scale-down to 4 left slot 4 failed: recover must not bring it back
    with pytest.raises(JoinError, match=r"^rank 4 is outside ep_size 4; use "
                                        r"--elastic-ep-join-mode scale$"):
        check_slots("recover", [4], 6, snap, 4)
    check_slots("recover", [4], 6, snap, 6)
    check_slots("scale", [5], 6, snap, 4)


def test_target_ep_size_from_store():
    import torch.distributed as dist

    from elasticep.entrypoints.coordinator_membership import TARGET_EP_SIZE_KEY
    from elasticep.entrypoints.join_cmd import target_ep_size

    store = dist.HashStore()
    assert target_ep_size(store, 4) == 4
    store.set(TARGET_EP_SIZE_KEY, "2")
    assert target_ep_size(store, 4) == 2


def test_join_reservation_is_exclusive_and_released():
    import torch.distributed as dist

    from elasticep.entrypoints.join_cmd import Reservations

    store, clock = dist.HashStore(), [1000.0]
    a = Reservations(store, host="h1", pid=1, clock=lambda: clock[0])
    b = Reservations(store, host="h2", pid=2, clock=lambda: clock[0], sleep=lambda s: None)
    a.acquire([2, 3])
    with pytest.raises(JoinError, match=r"^rank 3 is already being joined "
                                        r"\(elasticep join pid 1 on h1\)$"):
        b.acquire([4, 3])
    b.acquire([4])  # the refused attempt released its claim of 4
    b.release()
    clock[0] += 5
    a.refresh()
    clock[0] += 8  # refreshed 8 s ago: not stale
    with pytest.raises(JoinError):
        b.acquire([2])
    a.release()
    b.acquire([2, 3])
    b.release()


def test_join_reservation_stale_owner_is_taken_over():
    import os

    import torch.distributed as dist

    from elasticep.entrypoints.join_cmd import Reservations

    store, clock = dist.HashStore(), [1000.0]
    # an owner on this host whose process is gone: taken over at once
    dead = Reservations(store, host="me", pid=2 ** 22 + 12345, clock=lambda: clock[0])
    dead.acquire([0])
    me = Reservations(store, host="me", pid=os.getpid(), clock=lambda: clock[0],
                      sleep=lambda s: pytest.fail("no wait needed"))
    me.acquire([0])
    me.release()
    # a remote owner silent for over 10 s: taken over after watching it for a while...
    remote = Reservations(store, host="other", pid=7, clock=lambda: clock[0])
    remote.acquire([1])
    clock[0] += 11
    me = Reservations(store, host="me", pid=os.getpid(), clock=lambda: clock[0],
                      sleep=lambda s: None)
    me.acquire([1])
    me.release()
    # ...unless it refreshes meanwhile (its clock is just behind ours)
    remote = Reservations(store, host="other", pid=7, clock=lambda: clock[0] - 30)
    remote.acquire([2])

    def watch(seconds: float) -> None:
        clock[0] += seconds
        remote.refresh()

    me = Reservations(store, host="me", pid=os.getpid(), clock=lambda: clock[0], sleep=watch)
    with pytest.raises(JoinError, match="elasticep join pid 7 on other"):
        me.acquire([2])


def test_join_success_needs_our_own_worker():
    from elasticep.entrypoints.join_cmd import exit_reason, joined_ranks

    snap = _snapshot(["healthy", "healthy"], {0: 10655, 1: 11})
    assert not joined_ranks(snap, [0], {0: 777}, ("healthy",))  # another process's success
    assert joined_ranks(snap, [0], {0: 10655}, ("healthy",))
    assert not joined_ranks(snap, [0], {}, ("healthy",))
    tail = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
            "ValueError: slot 0 is already held by live pid 10655\n")
    assert exit_reason(tail) == "ValueError: slot 0 is already held by live pid 10655"
    assert exit_reason("loading\nkilled\n") == "killed"
    assert exit_reason("") == ""


def test_join_cli_refuses_a_slot_another_join_holds(capsys):
    """Two `join`s of one slot: the second is refused (exit 2, one line) before launching."""
    from elasticep.distributed import start_coordinator
    from elasticep.elastic.config import DeploymentConfig
    from elasticep.entrypoints import join_cmd
    from elasticep.entrypoints.launcher import open_store, publish_config

    coord = start_coordinator()
    try:
        store = open_store(coord.address)
        publish_config(store, DeploymentConfig(model="demo", ep_size=4, max_ep_size=4))
        other = join_cmd.Reservations(store, host="elsewhere", pid=4242)
        other.acquire([2])
        args = build_parser().parse_args(["join", "--dist-init-addr", coord.address,
                                          "--elastic-ep-join-mode", "recover", "--ranks", "2"])
        assert join_cmd.run(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["elasticep join: error: rank 2 is already being joined "
                       "(elasticep join pid 4242 on elsewhere)"]
        other.release()
        # free again: now the membership check answers (no ranks registered yet)
        assert join_cmd.run(args) == 2
        assert "no ranks yet" in capsys.readouterr().err
        assert store.get(join_cmd.RESERVATION_KEY.format(rank=2)) == b""  # released
    finally:
        coord.close()


class _JoinLauncher:
    """What `_report_progress` uses of RankLauncher: exits, status, pids, logs."""

    log_dir = None

    def __init__(self, states: list[str], pids: dict[int, int]) -> None:
        import queue

        self.exits: queue.Queue = queue.Queue()
        self.states, self._pids = states, pids

    def coordinator_status(self) -> dict:
        return _snapshot(self.states, self._pids)

    def pids(self, live_only: bool = True) -> dict[int, int]:
        return dict(self._pids)

    def log_tail(self, rank: int, lines: int = 40) -> str:
        return "loading\nRuntimeError: out of memory\n"


def test_join_progress_keeps_the_other_joiners_when_one_dies(capsys):
    """scale --ranks 4,5: joiner 5 dies while loading; joiner 4 still gets to ready."""
    import threading

    from elasticep.elastic.launcher import RankExit
    from elasticep.entrypoints.join_cmd import _report_progress

    launcher = _JoinLauncher(["healthy"] * 4 + ["ready", "failed"], {0: 1, 4: 104, 5: 105})
    launcher.exits.put(RankExit(5, 105, -9))
    assert _report_progress(launcher, "scale", [4, 5], threading.Event()) == [4]
    captured = capsys.readouterr()
    assert "rank 5 exited with -9 before it joined: RuntimeError: out of memory" in captured.err
    assert "still joining: ranks [4]" in captured.err
    assert captured.out.startswith("ready: ranks [4] loaded")
    launcher.exits.put(RankExit(4, 104, 1))  # every rank dies first: nothing got in
    launcher.states = ["healthy"] * 4 + ["failed", "failed"]
    assert _report_progress(launcher, "scale", [4], threading.Event()) == []
