"""A block-FP8 checkpoint through a rank death and a rejoin at EP2 (CPU, Gloo).

The experts stay FP8 in their slots, packed with their block scales
(:mod:`elasticep.moe.experts.fp8_block`). Rank 1 (no redundant replicas) SIGKILLs itself
inside a MoE layer: rank 0 reloads its orphans from the checkpoint into its reserved
slots and redoes the step. Then rank 1 is relaunched and takes its experts back from
rank 0 over the group (the slot rows, scales included). Every text equals the
fault-free FP8 run's.
"""

from __future__ import annotations

import re

import pytest
from _fp8_ckpt import write_fp8_checkpoint

from elasticep_testkit.ep import (
    assert_matches_reference,
    generated,
    launch,
    prompts,
    reference_for,
    worker_log,
)
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(300)

PROMPTS = prompts()[:4]


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return write_fp8_checkpoint(DEMO_MODEL, tmp_path_factory.mktemp("fp8"), ("lm_head",))


@pytest.fixture(scope="module")
def expected(fp8_ckpt):
    return reference_for(str(fp8_ckpt), PROMPTS)


@pytest.fixture(scope="module")
def driver(tmp_path_factory, fp8_ckpt, expected):
    d = launch(tmp_path_factory, model=fp8_ckpt, ep_size=2, ep_num_redundant_experts=0,
               fault="kill:rank=1:step=12:layer=3")
    yield d
    d.close()


def test_fp8_kill_reloads_packed_orphans_and_rejoin_takes_them_back(driver, expected):
    outs = generated(driver, list(PROMPTS))
    assert_matches_reference(outs, "FP8 EP2 R=0, rank 1 killed at step 12", expected)
    dep = driver.deployment
    assert dep.status().states() == {0: "healthy", 1: "failed"}
    log = worker_log(driver)
    assert "rank 1 SIGKILLs itself at step 12 layer 3" in log
    # 16 experts x 6 layers over 2 ranks: rank 1 held 8 a layer
    assert sum(int(n) for n in re.findall(r"(\d+) checkpoint reloads", log)) == 48
    dep.relaunch(1)
    dep.wait_healthy([0, 1], timeout_s=120)
    driver.wait_routable([0, 1])
    assert_matches_reference(generated(driver, list(PROMPTS)), "FP8 EP2 after rejoin", expected)
    # the joiner's experts (packed FP8 rows with their scales) came from rank 0's memory
    copied = re.findall(r"admitted: (\d+) experts copied from peers, (\d+) reloaded",
                        worker_log(driver))
    assert copied and int(copied[-1][0]) > 0 and copied[-1][1] == "0", copied
