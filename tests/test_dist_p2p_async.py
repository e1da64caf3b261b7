"""send/recv are asynchronous: a ring where every rank sends first completes, transfers
keep their order, and a dead peer fails only the transfers with it."""

import pytest
from _dist_harness import Cluster

import elasticep.membership as em


@pytest.mark.timeout(60)
def test_ring_order_and_dead_peer():
    coord = em.start_coordinator(hb_interval_s=0.1, hb_timeout_s=5.0)
    cl = Cluster(coord.address)
    try:
        for r in range(3):
            cl.start(r, "p2p_async", 3)
        cl.wait_for(lambda m: sum(x[1] == "dead" for x in m) == 2, 50, "dead-peer round")
        assert [cl.of(r, "ring")[0] for r in range(3)] == [20, 0, 10]
        sent, got = cl.of(0, "ordered")[0], cl.of(1, "ordered")[0]
        assert got == sent == [[i + 0.5] * 3 for i in range(4)]
        for r in (0, 1):
            dead, got = cl.of(r, "dead")[0]
            assert dead == [[2], [2]]
            assert got == (1 - r) + 7.0
    finally:
        cl.close()
        coord.close()
