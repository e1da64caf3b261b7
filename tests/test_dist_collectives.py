"""Every op and dtype of the elastic backend against a single-process reference, with
uneven all_to_all_single splits; then with a hole left by a departed rank, and with a
single member left (whose CPU ops skip the inner Gloo group: distributed/solo.py)."""

import pytest
from _dist_harness import coordinated_cluster


@pytest.mark.timeout(90)
def test_every_op_and_dtype_then_holes():
    with coordinated_cluster() as (_, cl):
        for r in range(4):
            cl.start(r, "collectives", 4, 5, leaver=3)  # capacity 5: slot 4 is a hole too
        cl.wait_for(lambda m: sum(x[1] == "holes" for x in m) == 3, 80, "both phases")
        for r in range(4):
            bad, mask, ws = cl.of(r, "full")[0]
            assert bad == [] and mask == [1, 1, 1, 1, 0] and ws == 5
        for r in range(3):
            bad, mask, _ = cl.of(r, "holes")[0]
            assert bad == [] and mask == [1, 1, 1, 0, 0]


@pytest.mark.timeout(90)
def test_every_op_with_one_member_left():
    with coordinated_cluster() as (_, cl):
        for r in range(2):
            cl.start(r, "collectives", 2, 2, leaver=1)
        cl.wait_for(lambda m: any(x[1] == "holes" for x in m), 80, "both phases")
        bad, mask, ws = cl.of(0, "holes")[0]
        assert bad == [] and mask == [1, 0] and ws == 2
        full, alone = cl.of(0, "full counters")[0], cl.of(0, "holes counters")[0]
        assert full["solo"] == 0
        # every op of the second phase went the one-member way
        assert alone["solo"] - full["solo"] == alone["run"] - full["run"] - 1 > 30
