"""Child-process hygiene: die with the parent, and kill only what we started.

Linux only: `PR_SET_PDEATHSIG` makes the kernel signal a child when the thread that
spawned it exits, so workers never outlive a killed front-end.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

from elasticep.utils.wait import wait_until

_PR_SET_PDEATHSIG = 1
# Set by a launcher in its children's environment: the pid they must die with.
PARENT_PID_ENV = "ELASTICEP_PARENT_PID"
# Set ("1") by a launcher whose workers may outlive it once they are members (`join`
# hands its admitted ranks over to the deployment): see :func:`outlive_parent`.
OUTLIVE_PARENT_ENV = "ELASTICEP_OUTLIVE_LAUNCHER"
# a file the worker creates once it no longer dies with its launcher (outlive_parent), so
# a launcher about to exit can wait for it instead of killing a just-admitted member
OUTLIVE_MARKER_ENV = "ELASTICEP_OUTLIVE_MARKER"


def die_with_parent(expected_parent_pid: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits.

    Args:
        expected_parent_pid: if given and the parent already changed (we were
            re-parented before the call), exit at once instead of lingering.
        sig: the signal to receive on parent death.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:  # not Linux/glibc: best effort only
        return
    if expected_parent_pid is not None and os.getppid() != expected_parent_pid:
        os._exit(1)


def outlive_parent() -> bool:
    """Undo :func:`die_with_parent` if this process's launcher allows it
    (``$ELASTICEP_OUTLIVE_LAUNCHER`` is "1"): from now on the parent's exit leaves this
    process running.

    Returns:
        True if the parent-death signal was cleared.
    """
    if os.environ.get(OUTLIVE_PARENT_ENV) != "1":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        cleared = libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0) == 0
    except OSError:
        return False
    marker = os.environ.get(OUTLIVE_MARKER_ENV)
    if cleared and marker:
        try:
            open(marker, "w").close()  # noqa: SIM115 - an empty file is the whole message
        except OSError:
            pass  # the launcher then stops waiting at its bound
    return cleared


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def kill_pids(pids: list[int], timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s`` seconds, the given pids only.

    Stopped (SIGSTOPped) processes get SIGCONT so they can act on SIGTERM.
    """
    live = [p for p in pids if pid_alive(p)]
    for p in live:
        for s in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.kill(p, s)
            except ProcessLookupError:
                pass
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not any(pid_alive(p) for p in live), timeout_s,
                   f"pids {live} to exit after SIGTERM")
    for p in live:
        if pid_alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
