"""Worker bodies for the multi-process tests of elasticep.distributed (not a test module).

Workers are started through a 'forkserver' context that preloads torch and the package,
so each start is a cheap fork of a thread-free server. Results go back on a per-worker
Pipe (never a shared Queue: a SIGKILLed writer would leave its lock held) as
(rank, kind, payload) tuples; `q` is the write end with a `put` method.
"""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist

import elasticep.distributed as ed


def _init(rank, addr, ws, mws, ext, on_failure="complete"):
    return ed.init_process_group(addr, rank, ws, max_world_size=mws, is_extension=ext,
                                 timeout_s=20.0, on_failure=on_failure)


class _Out:
    def __init__(self, conn):
        self.conn = conn

    def put(self, item):
        self.conn.send(item)


def main(rank, addr, ws, mws, ext, scenario, conn, args):
    """Entry point of every worker process; runs `scenario` and reports errors."""
    q = _Out(conn)
    try:
        globals()[scenario](rank, addr, ws, mws, ext, q, **args)
    except BaseException as e:  # report, never hang the parent
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        q.put((rank, "exit", None))
        os._exit(0)  # skip interpreter teardown of Gloo threads


def allreduce_loop(rank, addr, ws, mws, ext, q, iters=100000, duration_s=6.0):
    """all_reduce(rank + 1) in a loop; reports (seq, sum, time, epoch) per iteration."""
    _init(rank, addr, ws, mws, ext)
    q.put((rank, "ready", os.getpid()))
    t_end = time.monotonic() + duration_s
    i = 0
    while i < iters and time.monotonic() < t_end:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        q.put((rank, "sum", (i, float(t.item()), time.time(), ed.get_current_epoch(),
                             ed.get_active_ranks().tolist())))
        i += 1
        time.sleep(0.002)
    q.put((rank, "done", (ed.get_current_epoch(), ed.get_active_ranks().tolist())))
    time.sleep(0.5)
