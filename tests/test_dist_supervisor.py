"""The supervisor's CoordinatorClient: status with pids, a planned removal requested by
the supervisor and applied by the ranks at one step boundary, and a death reported by
waitpid (faster than the heartbeat timeout)."""

import signal
import time

import pytest
from _dist_harness import coordinated_cluster

import elasticep.membership as em


@pytest.mark.timeout(60)
def test_status_removal_and_reported_death():
    with coordinated_cluster(hb_interval_s=0.05, hb_timeout_s=8.0) as (coord, cl):
        client = em.CoordinatorClient(coord.address)
        try:
            for r in range(4):
                cl.start(r, "removal_loop", 4, duration_s=8.0)
            cl.wait_for(lambda m: sum(x[1] == "sum" for x in m) >= 20, 30, "sums")
            st = client.status()
            assert {int(r): v["pid"] for r, v in st["ranks"].items()} == \
                {r: p.pid for r, p in cl.procs.items()}
            assert st["groups"]["world"]["states"] == ["healthy"] * 4
            # planned removal of slot 3: draining, then removed at a step boundary
            client.request_deactivation([3])
            cl.wait_for(lambda m: cl.of(3, "raised") and all(cl.of(r, "removed") for r in range(4)),
                        20, "rank 3 removed")
            assert cl.of(3, "raised") == ["RankRemovedError"]
            steps = {cl.of(r, "removed")[0] for r in range(4)}
            assert len(steps) == 1  # every rank applied it at the same step
            assert client.status()["groups"]["world"]["states"][3] == "free"
            cl.wait_for(lambda m: any(s[1] == 6.0 for s in cl.of(0, "sum")), 20, "sum over 0..2")
            # a frozen rank reported dead by the supervisor is dropped before any heartbeat
            t0 = time.time()
            cl.kill(2, signal.SIGSTOP)
            client.report_death(2, pid=cl.procs[2].pid)
            cl.wait_for(lambda m: any(s[1] == 3.0 for s in cl.of(0, "sum")), 20, "sum over 0..1")
            assert time.time() - t0 < 8.0
            cl.wait_for(lambda m: all(cl.of(r, "done") for r in (0, 1)), 20, "done")
            for r in (0, 1):
                assert cl.of(r, "done")[0] == [1, 1, 0, 0]
                by = [s[1] for s in cl.of(r, "sum")]
                assert by[-1] == 3.0
            assert [s[:2] for s in cl.of(0, "sum")] == [s[:2] for s in cl.of(1, "sum")]
            assert client.status()["groups"]["world"]["states"] == [
                "healthy", "healthy", "failed", "free"]
        finally:
            client.close()
