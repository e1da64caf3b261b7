"""Every op and dtype of the elastic backend against a single-process reference, with
uneven all_to_all_single splits; then with a hole left by a departed rank."""

import pytest
from _dist_harness import Cluster

import elasticep.membership as em


@pytest.mark.timeout(90)
def test_every_op_and_dtype_then_holes():
    coord = em.start_coordinator(hb_interval_s=0.1, hb_timeout_s=5.0)
    cl = Cluster(coord.address)
    try:
        for r in range(4):
            cl.start(r, "collectives", 4, 5, leaver=3)  # capacity 5: slot 4 is a hole too
        cl.wait_for(lambda m: sum(x[1] == "holes" for x in m) == 3, 80, "both phases")
        for r in range(4):
            bad, mask, ws = cl.of(r, "full")[0]
            assert bad == [] and mask == [1, 1, 1, 1, 0] and ws == 5
        for r in range(3):
            bad, mask, _ = cl.of(r, "holes")[0]
            assert bad == [] and mask == [1, 1, 1, 0, 0]
    finally:
        cl.close()
        coord.close()
