"""EP4 with 16 redundant slots on the demo model: equal to EP1, and surviving kills.

One deployment for the module (starting ranks is the expensive part on 2 cores):
healthy batch, then rank 2 SIGKILLed mid-generation (every expert keeps a live
replica: nothing is reloaded), then rank 2 relaunched and admitted, then rank 0
killed. Every batch must equal the ep_size=1 reference token for token (near-tie rule).
Last, a seeded batch with penalties through one more kill equals its fault-free run.
"""

from __future__ import annotations

import re

import pytest

from elasticep.engine.request import SamplingParams
from elasticep_testkit.ep import (
    assert_matches_reference,
    generated,
    kill_after,
    launch,
    prompts,
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


# penalties, a bias, min_p and a seed: what a resumed request must rebuild from its tokens
PENALISED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, min_p=0.02, seed=21,
                           ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.6,
                           presence_penalty=0.3, logit_bias=((13, 1.5),))


def test_kill_with_penalties_and_seed_gives_the_fault_free_texts(driver):
    """A request moved to a survivor resumes from prompt + delivered tokens; its penalty
    counts and its draws (keyed on seed and token index) are rebuilt from those, so the
    texts equal the fault-free run's exactly (a flip would need two Gumbel-perturbed
    scores within float32 rounding of each other)."""
    prompt_ids = [list(p) for p in prompts()[:6]]
    free = driver.generate(prompt_ids, PENALISED, timeout_s=120)
    assert [o.error for o in free] == [None] * 6 and all(len(o.token_ids) == 16 for o in free)
    victim = next(r for r in (1, 2, 3) if driver.deployment.status().states()[r] == "healthy")
    moved = driver.frontend.tracker.resubmitted_total
    hit = driver.generate(prompt_ids, PENALISED, timeout_s=120,
                          on_event=kill_after(driver, victim, 30))
    assert driver.deployment.status().states()[victim] == "failed"
    assert driver.frontend.tracker.resubmitted_total > moved
    assert [o.text for o in hit] == [o.text for o in free]
    assert [o.token_ids for o in hit] == [o.token_ids for o in free]
