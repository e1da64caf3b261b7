"""gather / scatter / reduce on the elastic backend, over a group with a hole."""

import pytest
from _dist_harness import Cluster

import elasticep.membership as em


@pytest.mark.timeout(60)
def test_gather_scatter_reduce_with_hole():
    coord = em.start_coordinator(hb_interval_s=0.1, hb_timeout_s=5.0)
    cl = Cluster(coord.address)
    try:
        for r in range(3):
            cl.start(r, "rooted_ops", 3, 4)  # slot 3 is capacity nobody holds
        cl.wait_for(lambda m: sum(x[1] == "rooted" for x in m) == 3, 50, "rooted ops")
        for r in range(3):
            gathered, piece, red = cl.of(r, "rooted")[0]
            assert piece == [10 * r, 10 * r + 1]
            if r == 1:
                assert gathered == [[1.0, 0.0], [2.0, -1.0], [3.0, -2.0], [0.0, 0.0]]
                assert red == 3.0
            else:
                assert gathered is None and red == r + 1.0
    finally:
        cl.close()
        coord.close()
