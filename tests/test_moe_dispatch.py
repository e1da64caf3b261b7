"""Replica choice (static / dynamic) and the local expert compute, without processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from elasticep.eplb.elastic import repair_placement
from elasticep.eplb.metadata import ExpertLocationMetadata
from elasticep.eplb.placement import initial_placement
from elasticep.moe.exchange.uneven_exchange import choose_physical_slots
from elasticep.moe.experts.expert_compute import run_expert_rows


def _ids(T=64, E=8, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])


@pytest.mark.parametrize("algo", ["static", "dynamic"])
def test_chosen_slot_hosts_the_expert_on_a_live_rank(algo):
    p = repair_placement(initial_placement(2, 8, 4, 4), torch.tensor([True, True, False, True]))
    ids = _ids()
    for rank in (0, 1, 3):
        meta = ExpertLocationMetadata.from_placement(p, rank)
        for layer in range(2):
            slots = choose_physical_slots(meta, layer, ids, algo)
            assert torch.equal(p.phy2log[layer][slots], ids)
            assert bool(p.active_ranks[slots // p.slots_per_rank].all())


def test_static_uses_dispatch_map_and_dynamic_spreads_over_replicas():
    p = initial_placement(1, 8, 8, 4)  # every expert on two ranks
    meta = ExpertLocationMetadata.from_placement(p, 0)
    ids = torch.zeros(16, 1, dtype=torch.int64)  # 16 tokens for expert 0
    static = choose_physical_slots(meta, 0, ids, "static")
    assert static.unique().tolist() == [int(meta.logical_to_rank_dispatch_physical_map[0, 0])]
    dynamic = choose_physical_slots(meta, 0, ids, "dynamic")
    assert torch.bincount(dynamic.flatten()).tolist().count(8) == 2, "even split over 2 replicas"
    assert torch.equal(dynamic, choose_physical_slots(meta, 0, ids, "dynamic")), "deterministic"
    with pytest.raises(ValueError):
        choose_physical_slots(meta, 0, ids, "random")


def test_run_expert_rows_matches_per_row_mlp():
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(3, 8, 5, generator=g), torch.randn(3, 5, 4, generator=g)
    rows, slots = torch.randn(7, 5, generator=g), torch.tensor([2, 0, 2, 1, 0, 2, 1])
    out = run_expert_rows(w13, w2, rows, slots)
    for n in range(7):
        gate, up = (w13[slots[n]] @ rows[n]).chunk(2)
        torch.testing.assert_close(out[n], w2[slots[n]] @ (F.silu(gate) * up))
    assert run_expert_rows(w13, w2, rows[:0], slots[:0]).shape == (0, 5)
