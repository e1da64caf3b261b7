"""`elasticep serve` when a rank dies while loading at start-up (issue 17, item 9).

Serve must end with its own status (1) and its one error line, whatever native code
other threads of the process are running at that moment. The command runs through
``elasticep_testkit.native_thread_cli``: the real entry of the `elasticep` command, with
one more daemon thread that is nearly always inside a torch C++ call with the GIL
released, as serve's launcher threads were (TCPStore calls) when the issue was filed.
Leaving through a normal interpreter exit, such a thread is unwound through a
``noexcept`` C++ frame: "terminate called without an active exception", SIGABRT.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elasticep.utils.procs import pid_alive

pytestmark = pytest.mark.timeout(150)


def test_a_rank_dying_while_loading_ends_serve_with_its_status_and_line(tmp_path):
    env = {**os.environ, "ELASTICEP_FAULT": "kill:rank=1:loading"}
    serve = subprocess.run(
        [sys.executable, "-m", "elasticep_testkit.native_thread_cli", "serve", "--ep-size", "2",
         "--port", "0", "--dist-init-addr", "127.0.0.1:0", "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env)
    assert "terminate called" not in serve.stderr, serve.stderr[-3000:]
    assert serve.returncode == 1, serve.stderr[-3000:]
    assert [line for line in serve.stderr.splitlines() if "error:" in line] == [
        # the log file named: its tail printed below is not the whole log
        f"elasticep serve: error: rank 1 exited with -9 while loading; its log (rank1.log in "
        f"{tmp_path}) ends with:"]
    assert "fault injection: rank 1 SIGKILLs itself at loading" in serve.stderr
    assert serve.stdout == ""  # never ready
    pids = [int(p) for p in re.findall(r"rank \d started \(pid (\d+)", serve.stderr)]
    assert len(pids) == 2 and not any(pid_alive(p) for p in pids)


def test_a_rank_that_died_before_writing_its_log_is_said_so():
    """A rank SIGKILLed early left "its log ends with:" followed by nothing."""
    from elasticep.entrypoints.serve_cmd import loading_exit_message

    assert loading_exit_message(1, -9, "\n") == (
        "elasticep serve: error: rank 1 exited with -9 while loading; its log is empty")
    assert loading_exit_message(2, 1, "ValueError: x") == (
        "elasticep serve: error: rank 2 exited with 1 while loading; its log ends with:\n"
        "ValueError: x")
    assert loading_exit_message(2, -9, "loading layer 3\n", Path("/logs")) == (
        "elasticep serve: error: rank 2 exited with -9 while loading; its log (rank2.log in "
        "/logs) ends with:\nloading layer 3\n")
    tail = ("  File \"/x/loader.py\", line 42, in _proj\n    return reader.get(key)\n"
            "           ^^^^^^^^^^^^^^^\nValueError: tensor 'w' is stored as float8_e4m3fn\n")
    assert loading_exit_message(0, 1, tail, Path("/logs")) == (
        "elasticep serve: error: rank 0 exited with 1 while loading: ValueError: tensor 'w' "
        "is stored as float8_e4m3fn (traceback in rank0.log in /logs)")


def test_a_taken_port_is_refused_before_any_rank_starts(tmp_path):
    """`--port` held by another listener: serve exits 1 with one error line naming the
    address, before it starts a rank (no rank pid in its log, no worker log written)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        serve = subprocess.run(
            [sys.executable, "-m", "elasticep.entrypoints.cli", "serve", "--ep-size", "2",
             "--host", "127.0.0.1", "--port", str(port), "--dist-init-addr", "127.0.0.1:0",
             "--log-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=60)
    assert serve.returncode == 1, serve.stderr[-3000:]
    errors = [line for line in serve.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        f"elasticep serve: error: cannot serve HTTP on 127.0.0.1:{port} (--host/--port): "), errors
    assert not re.findall(r"rank \d started", serve.stderr), serve.stderr[-3000:]
    assert not list(tmp_path.rglob("rank*.log"))
    assert serve.stdout == ""
