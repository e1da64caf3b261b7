"""A survivor dies in the middle of an admission: the joiner must not die with it.

EP4 (capacity 5, 16 redundant experts) scales up to 5, and rank 3 SIGKILLs itself
either right after the placement has been shared with the joiner and before the
joiner's experts arrive (``kill:rank=3:admit=1``), or once the joiner is a member but
before the placement is shared (``kill:rank=3:admit_start=1``: the joiner's first
collective used to raise an uncaught RankFailureError, after `join` had shown it
healthy; issue 30). The other survivors abandon the admission and recover onto ranks
{0, 1, 2, 4}; the joiner must do the same instead of exiting on the RankFailureError of
the interrupted hand-over or expert transfer. Then greedy outputs equal EP1.
"""

from __future__ import annotations

import pytest

from elasticep_testkit.ep import assert_matches_reference, generated, launch, reference, worker_log

pytestmark = pytest.mark.timeout(240)

# fault -> where rank 3's log says it died
FAULTS = {"kill:rank=3:admit=1": "admission 1",
          "kill:rank=3:admit_start=1": "the start of admission 1"}


@pytest.fixture(scope="module", params=list(FAULTS))
def driver(request, tmp_path_factory):
    reference()
    d = launch(tmp_path_factory, ep_num_redundant_experts=16, max_ep_size=5,
               fault=request.param)
    d.fault = request.param
    yield d
    d.close()


def test_joiner_survives_a_death_during_its_admission(driver):
    dep = driver.deployment
    assert dep.scale(5, start_joiners=True)["slots"] == [4]
    dep.wait_healthy([0, 1, 2, 4], timeout_s=120)
    driver.wait_routable([0, 1, 2, 4])
    log = worker_log(driver)
    assert f"fault injection: rank 3 SIGKILLs itself at {FAULTS[driver.fault]}" in log
    assert "admission interrupted" in log  # the joiner took the recovery path
    assert dep.exit_codes.get(4) is None, dep.exit_codes  # the joiner is alive
    assert dep.exit_codes.get(3) == [-9], dep.exit_codes
    assert dep.active_ranks() == [0, 1, 2, 4]
    assert_matches_reference(generated(driver), f"EP4 {{0,1,2,4}} after {driver.fault}")
