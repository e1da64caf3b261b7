"""EP4 with 16 redundant slots on the demo model: equal to EP1, and surviving kills.

One deployment for the module (starting ranks is the expensive part on 2 cores):
healthy batch, then rank 2 SIGKILLed mid-generation (every expert keeps a live
replica: nothing is reloaded), then rank 2 relaunched and admitted, then rank 0
killed. Every batch must equal the ep_size=1 reference token for token (near-tie rule).
"""

from __future__ import annotations

import re

import pytest

from elasticep_testkit.ep import (
    assert_matches_reference,
    generated,
    kill_after,
    launch,
    reference,
    worker_log,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    reference()  # compute the EP1 reference before the ranks compete for the 2 cores
    d = launch(tmp_path_factory, ep_num_redundant_experts=16)
    yield d
    d.close()


def test_healthy_ep4_matches_ep1(driver):
    assert_matches_reference(generated(driver), "EP4 R=16 static")
    assert driver.deployment.status().epoch == 0


def test_kill_rank_mid_generation_with_redundancy(driver):
    outs = generated(driver, on_event=kill_after(driver, 2, 60))
    assert_matches_reference(outs, "EP4 R=16, rank 2 killed")
    states = driver.deployment.status().states()
    assert states == {0: "healthy", 1: "healthy", 2: "failed", 3: "healthy"}
    reloads = [int(n) for n in re.findall(r"(\d+) checkpoint reloads", worker_log(driver))]
    assert reloads and not any(reloads), "with redundancy no expert is reloaded"


def test_relaunch_then_kill_rank0(driver):
    dep = driver.deployment
    dep.relaunch(2)
    dep.wait_healthy([0, 1, 2, 3], timeout_s=90)
    driver.wait_routable([0, 1, 2, 3])
    assert_matches_reference(generated(driver), "EP4 R=16 after rejoin")
    outs = generated(driver, on_event=kill_after(driver, 0, 60))
    assert_matches_reference(outs, "EP4 R=16, rank 0 killed")
    states = dep.status().states()
    assert states == {0: "failed", 1: "healthy", 2: "healthy", 3: "healthy"}
