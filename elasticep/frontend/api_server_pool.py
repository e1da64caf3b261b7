"""A node's extra HTTP front-end processes (``serve --api-server-count N``, vLLM's
flag): N-1 processes (:mod:`.api_server_proc`) beside the node's own front-end, all
accepting on the one listening socket.

The processes inherit the socket serve bound (its file descriptor, passed at spawn),
not a port each with ``SO_REUSEPORT``: ``--port 0`` keeps working, no other program
can bind the port alongside, and connections wait in one accept queue, so those queued
when a process dies are taken by the others instead of being reset with it; a busy
process's loop accepts less often, which spreads the load on its own.

A process that dies is named in one log line and started again on the same socket and
link ports (the ranks' links reconnect; their periodic hello tells the new process of
them); its streams fail, the other processes' go on. Each incarnation gets its own
link origin id, and the pool hands a dead one's to ``on_death``: serve's own front-end
then tells every rank to abort that process's requests
(:class:`~elasticep.frontend_link.AbortOrigin`), which would otherwise decode for
nobody until their ``max_tokens``; the successor's requests carry a new id, so no
late cleanup can touch them. A process that dies more than :data:`MAX_RESTARTS` times
within :data:`RESTART_WINDOW_S` is not relaunched again (a rate, as systemd's
``StartLimitBurst`` within ``StartLimitIntervalSec``: a process that dies once a day is
always relaunched), and the pool says so through ``on_give_up``.

A process that lives on but no longer serves (stopped by a signal, or its event loop
stuck in a call that never returns) would hold its accepted connections open for ever,
their clients getting neither a token nor an error, while the ranks decode its requests
for nobody. So each process's loop, once it serves, beats on a counter in shared memory
(:mod:`.loop_beats`), and the watcher counts a process whose counter has not moved for
``stall_timeout_s`` (default :data:`~elasticep.frontend.loop_beats.STALL_TIMEOUT_S`) as
dead: it logs one line, SIGKILLs the process by pid, and the death path above runs (its
origin aborted, a relaunch within the budget). No stall is counted before a process's
first beat (its start-up) nor once the pool stops.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from elasticep.frontend.api_server_proc import ApiServerSpec, api_server_main
from elasticep.frontend.loop_beats import BEAT_S, STALL_TIMEOUT_S, BeatsSeen, stall_check
from elasticep.frontend.metrics import enable_multiprocess, process_died
from elasticep.frontend_link import LinkEndpoints

logger = logging.getLogger("elasticep.serve")

MAX_RESTARTS = 3  # relaunches of one process within RESTART_WINDOW_S
RESTART_WINDOW_S = 300.0  # seconds
START_TIMEOUT_S = 120.0  # for a process to bind its link (its imports included)
_WATCH_S = 0.2


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def count_death(deaths: tuple[float, ...], now: float, max_restarts: int = MAX_RESTARTS,
                window_s: float = RESTART_WINDOW_S) -> tuple[tuple[float, ...], bool]:
    """Count one more death of a process at ``now`` (pure).

    Args:
        deaths: the times of its earlier deaths that were still in the window at the
            last count (seconds of a monotonic clock, oldest first).
        now: the time of this death, same clock.
        max_restarts, window_s: the budget: relaunches within any ``window_s`` seconds.

    Returns:
        The deaths within ``window_s`` before ``now``, this one included, and whether
        the process is relaunched (at most ``max_restarts`` of them).
    """
    recent = (*(t for t in deaths if now - t < window_s), now)
    return recent, len(recent) <= max_restarts


class ApiServerPool:
    """Starts, watches and stops ``count`` extra front-end processes.

    Args:
        count: how many (the node's own front-end not included; >= 1).
        link_host: where their links bind (reachable by every rank).
        sock: the node's bound listening HTTP socket (serve keeps it open throughout).
        grace_s: seconds open streams get at a stop, as the node's own front-end's.
        on_give_up: told one line when a process died more than :data:`MAX_RESTARTS`
            times within :data:`RESTART_WINDOW_S` (serve then stops).
        stall_timeout_s: seconds a serving process's loop may go without a beat before
            the process is killed and relaunched.

    Raises:
        ValueError: ``stall_timeout_s`` is not above the beat period
            (:data:`~elasticep.frontend.loop_beats.BEAT_S`).

    Creating the pool makes the node's metrics directory and switches this process's
    metrics to it (:func:`~elasticep.frontend.metrics.enable_multiprocess`): create it
    before the node's own front-end. :meth:`stop` removes the directory.
    """

    def __init__(self, count: int, link_host: str, sock: socket.socket, grace_s: float,
                 on_give_up: Callable[[str], None] | None = None,
                 stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        if not stall_timeout_s > BEAT_S:
            raise ValueError(f"the stall timeout must be above the beat period of "
                             f"{BEAT_S} s, got {stall_timeout_s}")
        self.count, self.link_host, self.sock, self.grace_s = count, link_host, sock, grace_s
        self.stall_timeout_s = stall_timeout_s
        self.on_give_up = on_give_up
        self.metrics_dir = tempfile.mkdtemp(prefix="elasticep-metrics-")
        enable_multiprocess(self.metrics_dir)
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[BaseProcess | None] = [None] * count
        self._conns: list[Connection | None] = [None] * count
        # each incarnation's beat counter: shared memory rather than messages on its
        # pipe, so that a beat never blocks the process's loop on a pool that reads
        # late (the watcher may spend a start timeout relaunching another process), and
        # the start-up messages on the pipe stay as they are
        self._beats: list[ctypes.c_uint64 | None] = [None] * count
        self._seen: list[BeatsSeen] = [BeatsSeen()] * count
        self.endpoints: list[LinkEndpoints] = []
        self.deaths: list[tuple[float, ...]] = [()] * count  # within the window
        self.origins: list[str] = [""] * count  # each live incarnation's link origin id
        self.on_death: Callable[[str], None] | None = None
        self._spec: ApiServerSpec | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._joined = threading.Event()  # set once stop() has waited for the processes
        self._relaunching = threading.Lock()

    def start(self) -> list[LinkEndpoints]:
        """Spawn every process and wait until each bound its link.

        Returns:
            Their link endpoints, for the ranks (the deployment config).

        Raises:
            OSError: a process exited or stayed silent for :data:`START_TIMEOUT_S`.
        """
        for i in range(self.count):
            self._spawn(i, (0, 0))
        self.endpoints = [self._endpoints_of(i) for i in range(self.count)]
        return list(self.endpoints)

    def serve(self, spec: ApiServerSpec,
              on_death: Callable[[str], None] | None = None) -> None:
        """Let every process serve ``spec`` and start watching them; each one that dies
        from now on has its link origin id handed to ``on_death`` (in the pool's
        thread, before its relaunch), to abort its requests on the ranks
        (:meth:`~elasticep.frontend.core.Frontend.abort_origin`)."""
        self._spec, self.on_death = spec, on_death
        for i, conn in enumerate(self._conns):
            assert conn is not None
            try:
                conn.send(spec)
            except (OSError, EOFError):  # it died since it bound its link: start it again
                proc = self._procs[i]
                assert proc is not None
                proc.join(1.0)
                with self._relaunching:
                    if not self._relaunch(i, proc):
                        return
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name="api-server-pool")
        self._watcher.start()

    def wait_serving(self) -> None:
        """Wait until every process accepts on the socket (after :meth:`serve`); one
        that dies meanwhile is relaunched (within its budget) and waited for, as one that
        dies later is by the watcher.

        Raises:
            OSError: a process stayed silent for :data:`START_TIMEOUT_S`, or died more
                often than its budget allows (``on_give_up`` was told), or the pool is
                stopping.
        """
        with self._relaunching:
            for i in range(self.count):
                while True:
                    proc = self._procs[i]
                    try:
                        self._from_child(i, "start serving")
                        break
                    except OSError:
                        if proc is None or proc.is_alive() or self._stopping.is_set():
                            raise
                        if not self._relaunch(i, proc):
                            raise

    def _spawn(self, i: int, ports: tuple[int, int]) -> None:
        parent, child = self._ctx.Pipe()
        self.origins[i] = f"api{i + 1}-{uuid.uuid4().hex[:12]}"
        self._beats[i] = self._ctx.RawValue(ctypes.c_uint64, 0)
        self._seen[i] = BeatsSeen(0, time.monotonic())
        proc = self._ctx.Process(
            target=api_server_main, name=f"api-server-{i + 1}",
            args=(i + 1, self.link_host, ports, self.sock, child, self.metrics_dir,
                  os.getpid(), self.grace_s, self.origins[i], self._beats[i]))
        proc.start()
        child.close()
        self._procs[i], self._conns[i] = proc, parent

    def _endpoints_of(self, i: int) -> LinkEndpoints:
        return self._from_child(i, "bind its link")

    def _from_child(self, i: int, what: str) -> Any:
        """The next message of process ``i``.

        Raises:
            OSError: it exited or sent nothing for :data:`START_TIMEOUT_S`.
        """
        conn, proc = self._conns[i], self._procs[i]
        assert conn is not None and proc is not None
        try:
            if conn.poll(START_TIMEOUT_S):
                return conn.recv()
        except EOFError:
            pass
        proc.join(0.5)
        if proc.exitcode is not None:
            raise OSError(f"api server {i + 1} (pid {proc.pid}) exited with {proc.exitcode} "
                          f"before it could {what}")
        raise OSError(f"api server {i + 1} (pid {proc.pid}) did not {what} within "
                      f"{START_TIMEOUT_S:.0f} s")

    def _watch(self) -> None:
        try:
            while not self._stopping.wait(_WATCH_S):
                for i, proc in enumerate(self._procs):
                    if proc is None or self._stopping.is_set():
                        continue
                    if proc.is_alive() and self._silent_s(i) is None:
                        continue
                    with self._relaunching:
                        if self._stopping.is_set():
                            return
                        if self._procs[i] is not proc:  # wait_serving relaunched it
                            continue
                        if proc.is_alive():  # stalled; looked at again, as it may have
                            silent = self._silent_s(i)  # beaten while the lock was held
                            if silent is None:
                                continue
                            self._kill_stalled(i, proc, silent)
                        if not self._relaunch(i, proc):
                            return
        finally:
            # a process relaunched here dies with this thread (PR_SET_PDEATHSIG follows
            # the thread that forked it): keep the thread until the processes are gone
            self._joined.wait()

    def _has_served(self, i: int) -> bool:
        """Process ``i``'s loop has beaten: it serves, or served."""
        beats = self._beats[i]
        return beats is not None and beats.value > 0

    def _silent_s(self, i: int) -> float | None:
        """How long process ``i``'s loop has been silent if it is stalled, else None."""
        beats = self._beats[i]
        assert beats is not None
        # the time before the counter: a watcher held up between the two reads (its
        # process stopped) then reads a moved counter, not a silence of its own making
        now = time.monotonic()
        self._seen[i], silent = stall_check(self._seen[i], beats.value, now,
                                            self._stopping.is_set(), self.stall_timeout_s)
        return silent

    def _kill_stalled(self, i: int, proc: BaseProcess, silent: float) -> None:
        logger.warning("api server %d (pid %d) stalled: its event loop has not beaten for "
                       "%.1f s (stall timeout %g s); killing it", i + 1, proc.pid, silent,
                       self.stall_timeout_s)
        proc.kill()
        proc.join(5)

    def _relaunch(self, i: int, dead: BaseProcess) -> bool:
        """Start process ``i`` again after ``dead`` exited; False once it gave up."""
        process_died(dead.pid or 0)
        if self.on_death is not None:
            self.on_death(self.origins[i])
        self.deaths[i], relaunch = count_death(self.deaths[i], time.monotonic())
        if not relaunch:
            self._procs[i] = None
            msg = (f"api server {i + 1} (pid {dead.pid}) exited with {dead.exitcode}, "
                   f"its {len(self.deaths[i])}th death within {RESTART_WINDOW_S:.0f} s: "
                   f"not relaunched again (at most {MAX_RESTARTS} relaunches in that window)")
            logger.error("%s", msg)
            if self.on_give_up is not None:
                self.on_give_up(msg)
            return False
        logger.warning("api server %d (pid %d) exited with %s; its streams failed and the "
                       "ranks abort its requests; relaunching it on the same socket "
                       "(relaunch %d of at most %d within %.0f s)", i + 1, dead.pid,
                       dead.exitcode, len(self.deaths[i]), MAX_RESTARTS, RESTART_WINDOW_S)
        old = self.endpoints[i]
        try:
            self._spawn(i, (_port(old.request_addr), _port(old.output_addr)))
            self.endpoints[i] = self._endpoints_of(i)
            conn = self._conns[i]
            assert conn is not None and self._spec is not None
            conn.send(self._spec)
        except OSError as exc:
            if self._stopping.is_set():  # the stop's own SIGTERM ended the new process
                logger.info("api server %d: relaunch cut short by the stop", i + 1)
            else:
                logger.error("api server %d: relaunch failed: %s", i + 1, exc)
        return True

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop every process by pid (SIGTERM: streams get ``grace_s``; SIGKILL for one
        that has not served yet), wait up to ``timeout_s`` for each (default ``grace_s``
        + 5 s), SIGKILL what is left, and remove the metrics directory. Idempotent."""
        self.signal_stop()
        with self._relaunching:  # one the watcher relaunches now gets its SIGTERM too
            self.signal_stop()
        for i, proc in enumerate(self._procs):
            # one that has not served yet holds no stream, and it acts on its SIGTERM
            # only once its start-up ends (it waits for the spec, imports the server):
            # a stop during serve's start-up would wait for that for nothing
            if proc is not None and proc.is_alive() and not self._has_served(i):
                proc.kill()
        wait_s = self.grace_s + 5.0 if timeout_s is None else timeout_s
        # one deadline for all: waiting for each in turn made a stop during start-up
        # (processes still importing) take up to N times as long
        deadline = time.monotonic() + wait_s
        for proc in self._procs:
            if proc is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc is not None and proc.is_alive():
                logger.warning("api server (pid %d) still running %.0f s after its stop; "
                               "killing it", proc.pid, wait_s)
                proc.kill()
                proc.join(5)
        self._joined.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        for conn in self._conns:
            if conn is not None:
                conn.close()
        self._procs = [None] * self.count
        self._conns = [None] * self.count
        shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def signal_stop(self) -> None:
        """Send SIGTERM to every process (no wait), so they wind down while the node's
        own front-end does."""
        self._stopping.set()
        for proc in self._procs:
            if proc is not None and proc.is_alive():
                proc.terminate()
