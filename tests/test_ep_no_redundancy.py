"""EP4 without redundant slots (R = 0): equal to EP1, and a kill that orphans experts.

The kill uses the documented fault injection (``WorkerConfig.fault``, the same spec as
``ELASTICEP_FAULT``): rank 1 SIGKILLs itself inside MoE layer 3 of lockstep step 45,
i.e. during the second batch (a batch of 16 prompts x 32 tokens takes ~33 steps), while
the other ranks are in that layer's dispatch. Its experts have no other replica, so the
survivors grow their slots and reload them from the checkpoint, then redo the step.
"""

from __future__ import annotations

import re

import pytest

from elasticep_testkit.ep import assert_matches_reference, generated, launch, reference, worker_log

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    reference()
    d = launch(tmp_path_factory, ep_num_redundant_experts=0, fault="kill:rank=1:step=45:layer=3")
    yield d
    d.close()


def test_healthy_ep4_r0_matches_ep1(driver):
    assert_matches_reference(generated(driver), "EP4 R=0 static")
    assert driver.deployment.status().epoch == 0, "the fault fired in the first batch"


def test_fault_injected_kill_reloads_orphans(driver):
    assert_matches_reference(generated(driver), "EP4 R=0, rank 1 killed at step 45")
    states = driver.deployment.status().states()
    assert states == {0: "healthy", 1: "failed", 2: "healthy", 3: "healthy"}
    log = worker_log(driver)
    assert "rank 1 SIGKILLs itself at step 45 layer 3" in log
    reloads = [int(n) for n in re.findall(r"(\d+) checkpoint reloads", log)]
    # 16 experts x 6 layers over 4 ranks: rank 1 held 4 per layer, 24 in all.
    assert sum(reloads) == 24
    assert "redoing the pending step" in log
