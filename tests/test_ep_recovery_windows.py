"""A death inside an admission is one more membership change (issue 30, item 3): the
joiners must not die of it (a death before the hand-over: test_ep_admit_fault.py).

``kill:rank=0:admit=1``: EP1 scales to 2 and the only survivor dies right after it
shared the placement, before the joiner's experts arrive. The joiner then failed with
"no active rank is left" (no live rank holds any expert) and its scale slot stayed
failed; it must read every expert from the checkpoint, serve alone, and give the EP1
greedy outputs.
"""

from __future__ import annotations

import pytest

from elasticep.membership.transitions import SlotState
from elasticep_testkit.ep import assert_matches_reference, generated, launch, reference, worker_log

pytestmark = pytest.mark.timeout(300)


def test_the_last_survivor_dying_after_the_hand_over_leaves_the_joiner_serving(
        tmp_path_factory):
    reference()
    driver = launch(tmp_path_factory, ep_size=1, max_ep_size=2, fault="kill:rank=0:admit=1")
    try:
        dep = driver.deployment
        assert dep.scale(2, start_joiners=True)["slots"] == [1]
        dep.wait_healthy([1], timeout_s=150)
        driver.wait_routable([1])
        log = worker_log(driver)
        assert "fault injection: rank 0 SIGKILLs itself at admission 1" in log
        assert "no live rank holds an expert" in log  # the joiner rebuilt them
        assert "no active rank is left" not in log
        assert dep.exit_codes.get(1) is None, dep.exit_codes
        st = dep.deployment_status()
        assert [(r.rank, r.state) for r in st.ranks] == [(0, SlotState.FAILED),
                                                          (1, SlotState.HEALTHY)]
        assert_matches_reference(generated(driver), "the joiner alone after the last "
                                 "survivor died mid-admission")
    finally:
        driver.close()
