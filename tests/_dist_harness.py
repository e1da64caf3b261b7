"""Parent-side helpers for the multi-process elasticep.distributed tests."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.connection import wait

import _dist_workers

import elasticep.membership as em
from elasticep.utils.wait import wait_until

_CTX = None


def ctx():
    """A forkserver context that preloads torch and elasticep.distributed."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "elasticep.distributed", "_dist_workers"])
    return _CTX


class Cluster:
    """Worker processes of one test, each with its own result pipe."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.procs: dict[int, mp.Process] = {}
        self.conns: dict = {}
        self.msgs: list[tuple] = []

    def start(self, rank: int, scenario: str, ws: int, mws: int | None = None,
              ext: bool = False, **args) -> mp.Process:
        r, w = ctx().Pipe(duplex=False)
        p = ctx().Process(target=_dist_workers.main,
                          args=(rank, self.address, ws, mws or ws, ext, scenario, w, args))
        p.start()
        w.close()
        self.procs[rank] = p
        self.conns[r] = rank
        return p

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> float:
        """Signal one worker by its own pid; returns the time.time() of the signal."""
        t = time.time()
        os.kill(self.procs[rank].pid, sig)
        return t

    def poll(self, timeout: float = 0.05) -> list[tuple]:
        """Collect messages that arrived (rank, kind, payload); EOF pipes are dropped."""
        out = []
        for r in wait(list(self.conns), timeout):
            try:
                out.append(r.recv())
            except (EOFError, OSError):
                del self.conns[r]
        self.msgs += out
        return out

    def wait_for(self, pred, timeout: float, what: str) -> None:
        """Collect messages until pred(all messages) is true.

        Raises:
            AssertionError: a worker reported an error; TimeoutError: ``timeout`` seconds.
        """

        def done() -> bool:
            errs = [m for m in self.msgs if m[1] == "error"]
            assert not errs, errs
            if pred(self.msgs):
                return True
            self.poll()  # blocks up to 50 ms for the next message
            return False

        wait_until(done, timeout, what, poll_s=0.0)

    def of(self, rank: int, kind: str) -> list:
        return [m[2] for m in self.msgs if m[0] == rank and m[1] == kind]

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.join(5)


@contextlib.contextmanager
def coordinated_cluster(hb_interval_s: float = 0.1, hb_timeout_s: float = 5.0,
                        ) -> Iterator[tuple[em.Coordinator, Cluster]]:
    """A coordinator (heartbeat interval and timeout in seconds) and a :class:`Cluster` on
    it; on exit the workers are killed by pid, then the coordinator closes."""
    coord = em.start_coordinator(hb_interval_s=hb_interval_s, hb_timeout_s=hb_timeout_s)
    cl = Cluster(coord.address)
    try:
        yield coord, cl
    finally:
        cl.close()
        coord.close()
