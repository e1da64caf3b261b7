"""WORLD destroyed and initialised again in the same processes works (no hang, no
"slot already held"), and an op on a group this rank has not joined says so."""

import pytest
from _dist_harness import coordinated_cluster


@pytest.mark.timeout(60)
def test_destroy_and_reinit_world_then_unjoined_op():
    with coordinated_cluster() as (_, cl):
        for r in range(2):
            cl.start(r, "reinit_world", 2, 3)
        cl.wait_for(lambda m: sum(x[1] == "sums" for x in m) == 2, 50, "two inits")
        assert [cl.of(r, "sums")[0] for r in range(2)] == [(3.0, 3.0)] * 2
        cl.start(2, "reinit_world", 2, 3, ext=True)
        cl.wait_for(lambda m: any(x[1] == "not_joined" for x in m), 30, "joiner's error")
        msg = cl.of(2, "not_joined")[0]
        assert "has not joined" in msg and "join_group" in msg
