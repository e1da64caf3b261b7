"""EP4 with dynamic dispatch and online EPLB, then a scale-up to 5 ranks and back down.

One deployment (capacity 5, ``--enable-eplb`` every 8 steps, so experts move between
ranks during every batch): the healthy batch must equal EP1; a new rank joins (join
mode "scale"), receives replicas from peers and takes requests; then it is drained
(experts moved off it, requests moved to the others) and exits cleanly (code 0).
"""

from __future__ import annotations

import time

import pytest

from elasticep_testkit.ep import assert_matches_reference, generated, launch, reference, worker_log

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    reference()
    d = launch(tmp_path_factory, ep_num_redundant_experts=16, ep_dispatch_algorithm="dynamic",
               max_ep_size=5, enable_eplb=True, eplb_rebalance_num_iterations=8)
    yield d
    d.close()


def test_healthy_dynamic_matches_ep1(driver):
    assert_matches_reference(generated(driver), "EP4 R=16 dynamic + EPLB")
    assert "eplb rebalance: imbalance" in worker_log(driver)


def test_scale_up_then_down(driver):
    dep = driver.deployment
    assert dep.scale(5, start_joiners=True)["slots"] == [4]
    dep.wait_healthy([0, 1, 2, 3, 4], timeout_s=90)
    driver.wait_routable([0, 1, 2, 3, 4])
    assert_matches_reference(generated(driver), "EP5 after scale-up")
    assert dep.scale(4)["slots"] == [4]
    deadline = time.monotonic() + 60
    while dep.exit_codes.get(4) is None:
        assert time.monotonic() < deadline, "rank 4 did not leave"
        time.sleep(0.05)
    assert dep.exit_codes[4] == [0]
    states = dep.status().states()
    assert states[4] == "free" and dep.active_ranks() == [0, 1, 2, 3]
    assert_matches_reference(generated(driver), "EP4 after scale-down")
