"""EPLBManager: sliding window, rebalance schedule, imbalance metric."""

from __future__ import annotations

import logging

import pytest
import torch

from elasticep.eplb.manager import EPLBConfig, EPLBManager, compute_imbalance, rank_loads
from elasticep.eplb.placement import initial_placement


def test_rank_loads_and_imbalance_by_hand():
    p = initial_placement(1, 4, 0, 2)  # rank 0: experts 0,1; rank 1: experts 2,3
    counts = torch.tensor([[30, 10, 5, 5]])
    assert rank_loads(counts, p).tolist() == [[40.0, 10.0]]
    assert compute_imbalance(counts, p).tolist() == [pytest.approx(40 / 25)]
    assert compute_imbalance(torch.zeros(1, 4), p).tolist() == [1.0]
    # Replicas split an expert's load evenly: expert 0 on both ranks (R=2).
    p2 = initial_placement(1, 4, 2, 2)  # rank 0: 0,1,2; rank 1: 3,0,1
    assert rank_loads(torch.tensor([[30, 10, 5, 5]]), p2).tolist() == [[25.0, 25.0]]


def test_window_slides_and_schedule_fires():
    m = EPLBManager(1, 4, EPLBConfig(enabled=True, rebalance_num_iterations=3, window_size=2))
    fired = []
    for step in range(6):
        m.record(0, torch.full((1, 1), step % 4))
        fired.append(m.step())
    assert fired == [False, False, True, False, False, True]
    assert m.window_counts().tolist() == [[1, 1, 0, 0]]  # steps 4 and 5 only (experts 0, 1)
    m.reset_generator(epoch=7)
    assert [m.step() for _ in range(3)] == [False, False, True] and m.epoch == 7
    off = EPLBManager(1, 4, EPLBConfig(enabled=False, rebalance_num_iterations=1))
    assert off.step() is False


def test_rebalance_reduces_imbalance_and_logs(caplog):
    p = initial_placement(2, 16, 16, 4)
    m = EPLBManager(2, 16, EPLBConfig(enabled=True, rebalance_num_iterations=1, window_size=4), rank=1)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for layer in range(2):
            m.record(layer, (torch.rand(64, 2, generator=g) ** 3 * 16).long())
        m.step()
    with caplog.at_level(logging.INFO, logger="elasticep.eplb.manager"):
        res = m.rebalance(p)
    assert res.imbalance_after < res.imbalance_before
    assert int(res.placement.replica_counts().min()) >= 1
    assert "rank 1" in caplog.text and "->" in caplog.text


@pytest.mark.parametrize("fields", [{"window_size": 0}, {"rebalance_num_iterations": 0}])
def test_bad_config_raises(fields):
    with pytest.raises(ValueError, match="must be positive"):
        EPLBConfig(**fields)
