"""The coordinator as a child process (`membership/process.py`, issue 30 item 2): it
serves over its socket while its parent is paused, it dies with its parent, its own
death is reported to the parent, and a planned stop goes through the lifeline.

Every process here is started by the test (a parent helper, or the coordinator child of
this pytest process) and killed by its pid only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from elasticep.deploy.probe import reach_coordinator
from elasticep.entrypoints.serve_cmd import coordinator_exit_message
from elasticep.membership import CoordinatorClient
from elasticep.membership.process import CoordinatorProcess
from elasticep.utils.net import bind_tcp
from elasticep.utils.procs import pid_alive
from elasticep.utils.wait import wait_until

pytestmark = pytest.mark.timeout(120)

# A parent that starts a coordinator child, prints "<pid> <address>", then waits.
PARENT = textwrap.dedent("""
    import sys, time
    from elasticep.membership.process import CoordinatorProcess
    c = CoordinatorProcess.start(hb_timeout_s=2.0)
    print(c.pid, c.address, flush=True)
    time.sleep(600)
""")


def _parent_with_coordinator() -> tuple[subprocess.Popen, int, str]:
    """Start :data:`PARENT`; returns (it, the coordinator's pid, its address)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE,
                              text=True)
    line = parent.stdout.readline()  # bounded by the module's timeout
    pid, address = line.split()
    return parent, int(pid), address


def _kill_if_alive(pid: int) -> None:
    if pid_alive(pid):
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)


def test_serves_begins_a_planned_stop_and_closes():
    coord = CoordinatorProcess.start()
    try:
        assert coord.pid != os.getpid() and coord.exit_code() is None
        client = CoordinatorClient(coord.address, timeout_s=10)
        assert client.store_port == coord.store_port
        assert client.status()["groups"] == {}
        client.close()
        assert coord.begin_stop()
    finally:
        coord.close()
    assert not pid_alive(coord.pid)
    assert coord.exit_code() is None  # closed on purpose: no unexpected exit
    assert not coord.begin_stop()  # idempotent after close
    coord.close()


def test_its_death_is_reported_to_the_parent():
    died: list[int] = []
    event = threading.Event()

    def on_exit(code: int) -> None:
        died.append(code)
        event.set()

    coord = CoordinatorProcess.start(on_exit=on_exit)
    try:
        os.kill(coord.pid, signal.SIGKILL)
        assert event.wait(10), "on_exit was not called"
        assert died == [-signal.SIGKILL] and coord.exit_code() == -signal.SIGKILL
    finally:
        coord.close()


def test_a_node_that_probes_while_it_starts_finds_it():
    """Another node (or `join`) probing the address while the child still starts:
    refused connects (the parent bound the port, only the child listens, once it
    serves) are retried, never taken for something that does not speak the protocol."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found: list[bool] = []
    probe = threading.Thread(target=lambda: found.append(
        reach_coordinator(f"127.0.0.1:{port}", 60.0)))
    probe.start()
    coord = CoordinatorProcess.start(port=port)
    try:
        probe.join(60)
        assert found == [True]
    finally:
        coord.close()


def test_the_parents_socket_refuses_until_the_child_listens():
    """What the probe above relies on even when the child takes longer than a probe's
    handshake (a loaded host: the partition test's node 1 met that): the port the
    parent binds refuses connects; it does not accept one that nobody answers."""
    sock = bind_tcp("127.0.0.1", 0, socket.AF_INET)  # as CoordinatorProcess.start binds
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(sock.getsockname(), timeout=2).close()
    finally:
        sock.close()


def test_a_port_in_use_is_the_parents_own_error():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(OSError):
            CoordinatorProcess.start(port=taken.getsockname()[1])


def test_it_keeps_serving_while_its_parent_is_stopped():
    """SIGSTOP of the parent (serve's front-end) for 3 s, longer than the heartbeat
    timeout: the coordinator answers every call meanwhile, within a fraction of it."""
    parent, pid, address = _parent_with_coordinator()
    try:
        client = CoordinatorClient(address, timeout_s=5)
        os.kill(parent.pid, signal.SIGSTOP)
        try:
            worst = 0.0
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                t0 = time.monotonic()
                client.status()
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.1)
        finally:
            os.kill(parent.pid, signal.SIGCONT)
        client.close()
        assert worst < 1.0, f"a call took {worst:.2f} s while the parent was stopped"
        assert pid_alive(pid)
    finally:
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not pid_alive(pid), 15, "the coordinator to exit with its parent")
        _kill_if_alive(pid)


@pytest.mark.parametrize("stop_first", [False, True], ids=["running", "stopped"])
def test_it_does_not_outlive_its_parent(stop_first):
    """SIGKILL of the parent (even while it is SIGSTOPped): the child's lifeline reaches
    EOF and it exits; its listener goes with it."""
    parent, pid, address = _parent_with_coordinator()
    try:
        if stop_first:
            os.kill(parent.pid, signal.SIGSTOP)
        parent.kill()
        parent.wait(10)
        wait_until(lambda: not pid_alive(pid), 15, "the coordinator to exit with its parent")
        with pytest.raises(OSError):
            CoordinatorClient(address, timeout_s=2)
    finally:
        _kill_if_alive(pid)


def test_serves_error_line_names_the_pid_and_how_it_ended():
    assert "(pid 77) was killed by signal 9;" in coordinator_exit_message(77, -9)
    assert "(pid 77) exited with 1;" in coordinator_exit_message(77, 1)


def test_generate_ends_its_batch_when_the_coordinator_dies(tmp_path_factory):
    """`generate --ep-size`'s driver: the coordinator process dies mid-batch; every
    request ends with an error naming it, long before the batch's own timeout."""
    from elasticep.engine.request import SamplingParams
    from elasticep_testkit.ep import launch, prompts

    driver = launch(tmp_path_factory, ep_size=2)
    try:
        pid = driver.deployment.coordinator.pid
        seen = [0]

        def on_event(_i, _ev):
            seen[0] += 1
            if seen[0] == 4:
                os.kill(pid, signal.SIGKILL)

        t0 = time.monotonic()
        outs = driver.generate([list(p) for p in prompts()[:4]],
                               SamplingParams(max_tokens=2000, ignore_eos=True),
                               timeout_s=100, on_event=on_event)
        assert time.monotonic() - t0 < 60
        assert all(o.error and "coordinator process exited with -9" in o.error
                   for o in outs), [o.error for o in outs]
    finally:
        driver.close()


# A process that waits on the lifeline in a daemon thread, as the coordinator does, and
# exits while its parent (this test) still holds the pipe open: a coordinator deposed
# after a partition heals steps down exactly so.
STEPS_DOWN = textwrap.dedent("""
    import sys, threading, time
    from elasticep.membership.process import _read_lifeline
    stop = threading.Event()
    threading.Thread(target=_read_lifeline, args=(lambda: None, stop, lambda _a: None),
                     daemon=True).start()
    time.sleep(0.3)
    sys.exit(0)
""")


def test_a_coordinator_that_steps_down_with_its_lifeline_open_exits_cleanly():
    """Exit status 0, not SIGABRT: a buffered stdin read blocked in the lifeline thread
    held the buffer's lock, on which the exiting interpreter aborted."""
    proc = subprocess.Popen([sys.executable, "-c", STEPS_DOWN], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:  # the pipe stays open (no communicate(), which would close it) until it exits
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail("the process did not exit")
    finally:
        proc.stdin.close()
    assert proc.returncode == 0, proc.stderr.read()[-2000:]


# A standby replica's child with torch made unimportable and the campaign replaced by
# one that reports and ends the standby: it must reach its campaign all the same.
NO_TORCH_REPLICA = textwrap.dedent("""
    import importlib.abc, os, socket, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is not importable here")
            return None

    sys.meta_path.insert(0, NoTorch())
    from elasticep.membership import election, process

    def campaign_for(*args, **kwargs):
        print("campaigning; torch imported:", "torch" in sys.modules, flush=True)
        return None, None  # as a standby told to stop before it was elected

    election.campaign_for = campaign_for
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sys.exit(process.main(["--host", "127.0.0.1", "--listen-fd", str(sock.fileno()),
                           "--parent-pid", str(os.getppid()), "--hb-interval-s", "0.2",
                           "--hb-timeout-s", "2", "--join-hb-timeout-s", "30",
                           "--membership-store", "etcd://127.0.0.1:9", "--standby"]))
""")


def test_a_standby_replica_campaigns_before_torch_is_loaded():
    """torch (the rendezvous TCPStore) loads beside the campaign (membership/candidacy.py),
    so a replica that replaces a dead one is a candidate at once: here torch cannot be
    imported at all, and the child still campaigns, with torch not in sys.modules."""
    out = subprocess.run([sys.executable, "-c", NO_TORCH_REPLICA], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["campaigning; torch imported: False"], out.stderr[-3000:]


def test_a_start_given_up_ends_the_child_at_once(monkeypatch, caplog):
    """A start that gives up before the child serves (its timeout here; Ctrl-C of serve or
    generate likewise) used to wait 5 s for a child whose lifeline was still open, then
    warn "still runs 5 s after its lifeline closed; killing it"."""
    import elasticep.membership.process as process

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def record(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(process.subprocess, "Popen", record)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        CoordinatorProcess.start(ready_timeout_s=0.05)
    assert time.monotonic() - t0 < 2.0
    assert started and started[0].poll() is not None
    assert "killing it" not in caplog.text
