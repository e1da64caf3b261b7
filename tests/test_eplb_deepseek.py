"""DeepSeek-EPLB compatible rebalance_experts: the published example and invariants."""

from __future__ import annotations

import pytest
import torch

from elasticep.eplb.deepseek import balanced_packing, rebalance_experts

# The example of DeepSeek EPLB's README: 2 layers, 12 experts in 4 groups, 16 replicas
# on 2 nodes x 4 GPUs (hierarchical policy), with its printed phy2log.
README_WEIGHT = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = torch.tensor(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


def _check_consistent(phy2log, log2phy, logcnt, num_replicas):
    L, E, X = log2phy.shape
    assert phy2log.shape == (L, num_replicas) and logcnt.shape == (L, E)
    assert int(logcnt.min()) >= 1, "every logical expert keeps a replica"
    assert torch.equal(logcnt.sum(-1), torch.full((L,), num_replicas))
    assert torch.equal((log2phy >= 0).sum(-1), logcnt)
    for layer in range(L):
        for e in range(E):
            slots = log2phy[layer, e, : int(logcnt[layer, e])]
            assert torch.all(phy2log[layer, slots] == e), "log2phy inverts phy2log"
            assert torch.all(log2phy[layer, e, int(logcnt[layer, e]) :] == -1)


def test_readme_example_reproduced_exactly():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert torch.equal(phy2log, README_PHY2LOG)
    _check_consistent(phy2log, log2phy, logcnt, 16)


@pytest.mark.parametrize("seed", range(4))
def test_global_policy_invariants(seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(0, 200, (3, 16), generator=g)
    # 3 groups do not divide among 2 nodes -> global policy.
    phy2log, log2phy, logcnt = rebalance_experts(weight[:, :15], 20, 3, 2, 4)
    _check_consistent(phy2log, log2phy, logcnt, 20)
    phy2log, log2phy, logcnt = rebalance_experts(weight, 24, 4, 2, 4)
    _check_consistent(phy2log, log2phy, logcnt, 24)


def test_balanced_packing_fills_packs_equally():
    weight = torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0, 3.0]])
    pack, rank = balanced_packing(weight, 3)
    assert torch.equal(torch.bincount(pack[0], minlength=3), torch.tensor([2, 2, 2]))
    loads = torch.zeros(3).index_add_(0, pack[0], weight[0])
    assert float(loads.max() - loads.min()) <= 1.0
    assert sorted(rank[0].tolist()) == [0, 0, 0, 1, 1, 1]


def test_bad_sizes_raise_value_error():
    with pytest.raises(ValueError):
        rebalance_experts(README_WEIGHT, 15, 4, 2, 8)
    with pytest.raises(ValueError):
        balanced_packing(torch.ones(1, 5), 2)
