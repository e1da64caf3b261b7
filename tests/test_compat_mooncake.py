"""elasticep.compat.mooncake keeps Mooncake PG's contract: plain env:// start-up with a
detached coordinator that leaves with the last rank, active-rank sizes and buffers,
a joiner that runs solo before join_group, manual membership with per-op results."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist_harness import Cluster

from elasticep.compat.mooncake import pg
from elasticep.utils.wait import wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_options_forms():
    a = pg.MooncakeBackendOptions(4, True, False, False)
    assert (a.max_group_size, a.is_extension, a.auto_deactivate_on_failure,
            a.auto_sync_on_failure) == (4, True, False, False)
    b = pg.MooncakeBackendOptions(torch.tensor([1, 1, 0]), False)
    assert b.max_group_size == 3 and b.active_ranks.tolist() == [1, 1, 0]
    c = pg.MooncakeBackendOptions(torch.tensor([1]), True, 2)
    assert (c.max_group_size, c.is_extension, c.auto_deactivate_on_failure) == (2, True, True)
    with pytest.raises(TypeError, match="takes"):
        pg.MooncakeBackendOptions(2, True, True, True, 5)


@pytest.mark.timeout(90)
def test_extension_sizes_and_detached_coordinator():
    cl = Cluster(str(_free_port()))
    try:
        for r in range(2):
            cl.start(r, "mooncake_extension", 2, 3)
        cl.wait_for(lambda m: sum(x[1] == "coord" for x in m) == 2, 40, "WORLD")
        cl.start(2, "mooncake_extension", 2, 3, ext=True)
        cl.wait_for(lambda m: sum(x[1] == "sizes" for x in m) == 3, 80, "extension")
        for r in range(3):
            before, status, ws, total, gathered, rs = cl.of(r, "sizes")[0]
            assert before == ((2, [1, 2]) if r < 2 else (3, 5))
            assert status == ("Applied" if r < 2 else None)
            assert (ws, total, gathered, rs) == (3, 6, [0, 10, 20], 3 * r + 3)
        host, port = cl.of(0, "coord")[0].split(":")
        cl.wait_for(lambda m: sum(x[1] == "exit" for x in m) == 3, 20, "ranks to exit")
        def coordinator_gone() -> bool:  # it exits once no rank is left
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
            except OSError:
                return True
            return False

        wait_until(coordinator_gone, 15, "the coordinator to exit after its ranks", poll_s=0.3)
    finally:
        cl.close()


@pytest.mark.timeout(90)
def test_manual_membership_reports_failure_not_stale_sums():
    cl = Cluster(str(_free_port()))
    try:
        for r in range(3):
            cl.start(r, "mooncake_manual", 3)
        cl.wait_for(lambda m: sum(x[1] == "manual" for x in m) == 2, 80, "manual rounds")
        for r in range(2):
            rows, probe_ok, sync, deactivated = cl.of(r, "manual")[0]
            assert rows[0] == (6, True, [0, 0, 0], [1, 1, 1])
            # the survivors' sum (never one with slot 2's stale input), flagged failed,
            # and slot 2 stays in the view until deactivate_ranks
            assert rows[1] == (3, False, [0, 0, 1], [1, 1, 1])
            assert rows[2] == (3, True, [0, 0, 0], [1, 1, 0])
            assert (probe_ok, sync, deactivated) == (False, "Reconciled", "Applied")
    finally:
        cl.close()


@pytest.mark.timeout(90)
def test_reinit_with_root_destroying_last_then_clean_exit(tmp_path):
    # Rank 0 hosts env://'s store server; rank 1 checks in for its second init while rank
    # 0 still holds the first WORLD (Mooncake's own test hits this order at random). Each
    # rank is a plain interpreter, as under mp.spawn: it must also exit with code 0 after
    # destroy_process_group, not abort in teardown.
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(tests), str(tests.parent), os.environ.get("PYTHONPATH")])))
    script = ("import sys, _dist_workers as w\n"
              "class Q:\n    put = staticmethod(lambda m: print(repr(m), flush=True))\n"
              "w.mooncake_reinit_late_root(int(sys.argv[1]), int(sys.argv[2]), 2, 2, False, "
              "Q(), flags=sys.argv[3])\n")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), port, str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=75) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}: {err[-2000:]}"
        assert out.strip() == repr((r, "sums", (3, 3, 7 * r))), out
