"""Fault primitives shared by the failover bench and the chaos suite: signal rank
workers, and wait for the coordinator to commit a membership without / with them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

from elasticep.utils.procs import pid_alive
from elasticep.utils.wait import wait_until
from elasticep_testkit.harness.serve_process import ServeProcess
from elasticep_testkit.harness.status_watch import Snapshot, StatusWatch

logger = logging.getLogger(__name__)

DETECT_BOUND_S = 30.0  # a dead rank must leave the membership within this (seconds)


def signal_ranks(serve: ServeProcess, ranks: tuple[int, ...] | list[int], sig: int,
                 gap_s: float = 0.0) -> list[tuple[float, int, int]]:
    """Send ``sig`` to each rank's worker (pid from ``/elastic_ep_status``), ``gap_s``
    seconds apart.

    Returns:
        (monotonic time sent, rank, pid) per rank.

    Raises:
        LookupError: a rank has no pid in the status.
    """
    sent = []
    for i, rank in enumerate(ranks):
        if i and gap_s > 0:
            time.sleep(gap_s)
        pid = serve.signal_rank(rank, sig)
        sent.append((time.monotonic(), rank, pid))
        logger.info("%s rank %d (pid %d)", signal.Signals(sig).name, rank, pid)
    return sent


def wait_out(watch: StatusWatch, ranks: tuple[int, ...] | list[int], since: float,
             bound_s: float = DETECT_BOUND_S) -> Snapshot:
    """The first membership committed at or after ``since`` with none of ``ranks``.

    Raises:
        TimeoutError: not within ``bound_s`` seconds.
    """
    return watch.wait_for(lambda s: not set(ranks) & set(s.active), bound_s,
                          f"ranks {list(ranks)} out of the membership", after=since)


def wait_in(watch: StatusWatch, ranks: tuple[int, ...] | list[int], since: float,
            bound_s: float) -> Snapshot:
    """The first membership committed at or after ``since`` with all of ``ranks``.

    Raises:
        TimeoutError: not within ``bound_s`` seconds.
    """
    return watch.wait_for(lambda s: set(ranks) <= set(s.active), bound_s,
                          f"ranks {list(ranks)} admitted", after=since)


def resume(pid: int, expect_exit_s: float = 0.0) -> bool:
    """SIGCONT a frozen worker; with ``expect_exit_s`` > 0, wait that long for it to
    exit by itself (an evicted rank must, once it runs again).

    Returns:
        True if the process is gone (always False when ``expect_exit_s`` is 0 and it
        still runs).
    """
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return True
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not pid_alive(pid), expect_exit_s, f"pid {pid} to exit", poll_s=0.1)
    return not pid_alive(pid)
