"""Worker processes of the multi-process benchmarks (bench/collectives.py, bench/gpu_run.py).

A worker is ``target(rank, addr, conn, *args)``: it sends tuples ``(kind, *payload)``
over ``conn``; the parent keeps them as ``(rank, kind, *payload)`` in ``Procs.msgs``.
Every process started is killed by pid at ``close`` (SIGCONT first, so a SIGSTOPped
one dies too), including those already dropped from ``procs`` by a relaunch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import traceback
from multiprocessing.connection import wait


def worker(fn):
    """Wrap a worker: a traceback goes to the parent as ``("error", text)`` (``poll``
    raises on it); the process then lingers 1 s, so its peers finish their last op
    with it, and exits without running any teardown."""

    @functools.wraps(fn)
    def run(rank, addr, conn, *args):
        try:
            fn(rank, addr, conn, *args)
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        time.sleep(1.0)
        os._exit(0)

    return run


class Procs:
    def __init__(self, ctx, addr):
        self.ctx, self.addr, self.procs, self.conns, self.msgs = ctx, addr, {}, {}, []
        self._started = []

    def start(self, rank, target, *args):
        r, w = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=target, args=(rank, self.addr, w, *args))
        p.start()
        w.close()
        self.procs[rank], self.conns[r] = p, rank
        self._started.append(p)

    def poll(self, until, timeout=60.0):
        """Collect messages until ``until()``; raise on a worker's error or the timeout."""
        deadline = time.monotonic() + timeout
        while not until():
            errs = [m for m in self.msgs if m[1] == "error"]
            if errs:
                raise RuntimeError(f"worker failed: {errs}")
            if time.monotonic() > deadline:
                raise TimeoutError("benchmark phase did not finish in time")
            if not self.conns:
                time.sleep(0.05)
            for r in wait(list(self.conns), 0.05):
                try:
                    self.msgs.append((self.conns[r], *r.recv()))
                except (EOFError, OSError):
                    del self.conns[r]

    def of(self, rank, kind):
        """Payload tuples of ``rank``'s messages of ``kind``, in order."""
        return [m[2:] for m in self.msgs if m[0] == rank and m[1] == kind]

    def got(self, rank, kind):
        """First payload element of ``rank``'s messages of ``kind``, in order."""
        return [m[0] for m in self.of(rank, kind)]

    def count(self, kind):
        return sum(m[1] == kind for m in self.msgs)

    def kill(self, rank, sig=signal.SIGKILL):
        os.kill(self.procs[rank].pid, sig)

    def reap(self, rank):
        """Wait (5 s at most) for ``rank``'s process to end and forget it."""
        self.procs.pop(rank).join(5)

    def close(self):
        for p in self._started:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
            p.join(5)
