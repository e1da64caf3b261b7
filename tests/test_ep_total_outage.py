"""Every rank dies; relaunched ranks must form the deployment again by themselves.

EP4 (16 redundant experts). All four workers are SIGKILLed while idle, so the group is
left with no member. Ranks 0 and 2 are relaunched in join mode "recover": nobody is
left to admit them, so the coordinator admits the ready slots itself, and with no
member holding a placement they rebuild the launch placement over {0, 2} from the
checkpoint. Greedy outputs must then equal EP1 again.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from elasticep_testkit.ep import assert_matches_reference, generated, launch, reference, worker_log

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    reference()
    d = launch(tmp_path_factory, ep_num_redundant_experts=16)
    yield d
    d.close()


def test_relaunched_ranks_recover_from_a_total_outage(driver):
    dep = driver.deployment
    assert_matches_reference(generated(driver), "EP4 before the outage")
    for pid in dep.pids().values():
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while dep.active_ranks():
        assert time.monotonic() < deadline, f"still active: {dep.active_ranks()}"
        time.sleep(0.1)
    dep.relaunch(0)
    dep.relaunch(2)
    dep.wait_healthy([0, 2], timeout_s=150)
    driver.wait_routable([0, 2])
    assert dep.active_ranks() == [0, 2]
    assert "no member holds a placement: rebuilding from the checkpoint" in worker_log(driver)
    assert_matches_reference(generated(driver), "EP2 {0, 2} rebuilt after a total outage")
