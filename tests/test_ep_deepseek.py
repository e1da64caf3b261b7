"""EP4 on a tiny DeepSeek-V3-style checkpoint: equal to EP1, and surviving a killed rank.

The checkpoint (tests/_deepseek_ckpt.py, "v3") has MLA, a dense first layer, shared
experts (replicated on every rank, never placed) and sigmoid noaux_tc routing with a
correction bias. Two deployments:
- R = 0 with EPLB every 8 steps: rank 1 SIGKILLs itself inside MoE layer 2 during the
  second batch; its experts have no replica, so the survivors reload them from the
  checkpoint and redo;
- R = 8: rank 2 is SIGKILLed from outside mid-generation; every expert keeps a replica.
Every batch must equal the EP1 reference token for token (DESIGN's near-tie rule).
"""

from __future__ import annotations

import re

import pytest
import torch
from _deepseek_ckpt import build

from elasticep_testkit.ep import (
    assert_matches_reference,
    generated,
    kill_after,
    launch,
    reference_for,
    worker_log,
)

pytestmark = pytest.mark.timeout(240)

NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """(checkpoint dir, prompts, EP1 reference) of the tiny V3-style model."""
    path = tmp_path_factory.mktemp("deepseek-v3")
    build("v3", path, seed=5)
    gen = torch.Generator().manual_seed(1)
    prompts = tuple(tuple(torch.randint(1, 8192, (int(n),), generator=gen).tolist())
                    for n in torch.randint(16, 33, (NUM_PROMPTS,), generator=gen))
    return path, prompts, reference_for(str(path), prompts)


def test_ep4_r0_equals_ep1_then_reloads_orphans_after_a_kill(v3, tmp_path_factory):
    path, prompts, ref = v3
    # EPLB every 8 steps moves experts between ranks (weight transfer skips the dense layer 0).
    # --min-ep-size 4: no reserved slots, which EPLB would fill with replicas (and the kill
    # would then orphan fewer experts than the count below)
    d = launch(tmp_path_factory, model=path, ep_num_redundant_experts=0, fault="kill:rank=1:step=45:layer=2",
               enable_eplb=True, eplb_rebalance_num_iterations=8, min_ep_size=4)
    try:
        assert_matches_reference(generated(d, prompts), "DeepSeek EP4 R=0", ref)
        assert d.deployment.status().epoch == 0, "the fault fired in the first batch"
        assert_matches_reference(generated(d, prompts), "DeepSeek EP4 R=0, rank 1 killed", ref)
        states = d.deployment.status().states()
        assert states == {0: "healthy", 1: "failed", 2: "healthy", 3: "healthy"}
        log = worker_log(d)
    finally:
        d.close()
    assert "rank 1 SIGKILLs itself at step 45 layer 2" in log
    assert "eplb rebalance: imbalance" in log
    # 8 experts x 2 MoE layers (layer 0 is dense) over 4 ranks: rank 1 held 2 per layer
    assert sum(int(n) for n in re.findall(r"(\d+) checkpoint reloads", log)) == 4


def test_ep4_with_redundancy_survives_a_kill(v3, tmp_path_factory):
    path, prompts, ref = v3
    # R = 8: 16 slots, every expert on two ranks, so a kill orphans nothing
    d = launch(tmp_path_factory, model=path, ep_num_redundant_experts=8)
    try:
        assert_matches_reference(generated(d, prompts), "DeepSeek EP4 R=8", ref)
        outs = generated(d, prompts, on_event=kill_after(d, 2, 60))
        assert_matches_reference(outs, "DeepSeek EP4 R=8, rank 2 killed", ref)
        states = d.deployment.status().states()
        assert states == {0: "healthy", 1: "healthy", 2: "failed", 3: "healthy"}
        reloads = [int(n) for n in re.findall(r"(\d+) checkpoint reloads", worker_log(d))]
    finally:
        d.close()
    assert reloads and not any(reloads), "with redundancy no expert is reloaded"
