"""Slots, the initial placement, and ExpertLocationMetadata built from a placement."""

from __future__ import annotations

import pytest
import torch

from elasticep.eplb.metadata import ExpertLocationMetadata, compute_rank_dispatch_map
from elasticep.eplb.placement import Placement, initial_placement, initial_slots_per_rank


def test_slots_per_rank_and_capacity():
    assert initial_slots_per_rank(8, 0, 4) == 2
    assert initial_slots_per_rank(8, 16, 4) == 6
    assert initial_slots_per_rank(10, 1, 4) == 3
    p = initial_placement(2, 8, 4, initial_ep_size=4, max_ep_size=6)
    assert p.slots_per_rank == 3 and p.num_slots == 18
    assert p.slot_rank().tolist() == [r for r in range(6) for _ in range(3)]


def test_initial_placement_is_p_mod_e_with_inactive_slots_empty():
    p = initial_placement(2, 8, 4, initial_ep_size=4, max_ep_size=6)
    live = 3 * 4
    assert p.phy2log[:, :live].tolist() == [[s % 8 for s in range(live)]] * 2
    assert torch.all(p.phy2log[:, live:] == p.empty)
    assert p.live_ranks() == [0, 1, 2, 3]


@pytest.mark.parametrize("E,R,N", [(8, 0, 4), (8, 4, 4), (16, 16, 4), (6, 3, 3), (60, 4, 4)])
def test_initial_replicas_on_distinct_ranks(E, R, N):
    p = initial_placement(1, E, R, N)
    for r in range(N):
        held = p.local(r)[0]
        held = held[held != p.empty]
        assert held.unique().numel() == held.numel()
    assert int(p.replica_counts().min()) >= 1


def test_log2phy_inverts_phy2log():
    p = initial_placement(3, 8, 5, 4, max_ep_size=5)
    log2phy, cnt = p.log2phy()
    for layer in range(3):
        seen = []
        for e in range(8):
            slots = log2phy[layer, e, : int(cnt[layer, e])]
            assert torch.all(p.phy2log[layer, slots] == e)
            assert torch.all(log2phy[layer, e, int(cnt[layer, e]) :] == -1)
            seen += slots.tolist()
        assert sorted(seen) == torch.nonzero(p.valid()[layer]).flatten().tolist()


def test_placement_rejects_expert_on_inactive_rank():
    p = initial_placement(1, 4, 0, 2, max_ep_size=3)
    bad = p.phy2log.clone()
    bad[0, -1] = 0
    with pytest.raises(ValueError):
        Placement(bad, 4, p.slots_per_rank, p.active_ranks)
    with pytest.raises(ValueError):
        Placement(p.phy2log.int(), 4, p.slots_per_rank, p.active_ranks)
    with pytest.raises(ValueError):
        initial_placement(1, 8, 0, 4, active_ranks=torch.tensor([True, False, False, False]))


def test_with_slots_per_rank_keeps_rank_and_local_slot():
    p = initial_placement(1, 8, 0, 4)
    g = p.with_slots_per_rank(3)
    for r in range(4):
        assert g.local(r)[0, :2].tolist() == p.local(r)[0].tolist()
        assert int(g.local(r)[0, 2]) == g.empty


def test_metadata_tensors_and_static_nearest_dispatch():
    p = initial_placement(2, 8, 4, 4)  # 3 slots per rank; experts 0-3 twice
    for rank in range(4):
        m = ExpertLocationMetadata.from_placement(p, rank)
        assert m.physical_to_logical_map.shape == (2, 12) and m.physical_to_logical_map.dtype == torch.int64
        # padded to the layout's replica width (4 ranks x ceil(3 / 8)), not the 2 used
        assert p.replica_width() == 4
        assert m.logical_to_all_physical_map.shape == (2, 8, 4)
        assert m.logical_to_all_physical_map[0, 0].tolist()[2:] == [-1, -1]
        assert m.logical_to_all_physical_map_num_valid[0].tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
        d = m.logical_to_rank_dispatch_physical_map
        assert torch.all(p.phy2log.gather(1, d) == torch.arange(8)), "dispatch hits a replica"
        own = p.local(rank)[0].tolist()
        for e in own:
            assert int(d[0, e]) // 3 == rank, "own replica first"
    # Expert 3 lives on ranks 1 (slot 3) and 3 (slot 11): rank 0 and 1 pick rank 1,
    # rank 2 goes forward around the ring to rank 3.
    picks = [int(ExpertLocationMetadata.from_placement(p, r).logical_to_rank_dispatch_physical_map[0, 3]) for r in range(4)]
    assert picks == [3, 3, 11, 11]


def test_dispatch_map_skips_padding():
    log2phy = torch.tensor([[[5, -1], [0, 4]]])
    assert compute_rank_dispatch_map(log2phy, 2, 3, 2).tolist() == [[5, 4]]


def test_min_ep_size_reserves_empty_slots():
    """--min-ep-size: each rank gets ceil(E / min) slots, the launch ones filled as
    without it and the rest EMPTY, so the survivors of a death can take the orphans."""
    assert initial_slots_per_rank(16, 0, 2, min_ep_size=1) == 16
    assert initial_slots_per_rank(16, 0, 4, min_ep_size=3) == 6
    assert initial_slots_per_rank(16, 16, 4, min_ep_size=3) == 8  # redundancy covers it
    with pytest.raises(ValueError, match="min_ep_size"):
        initial_slots_per_rank(16, 0, 2, min_ep_size=3)
    p = initial_placement(2, 16, 0, 4, max_ep_size=5, min_ep_size=3)
    plain = initial_placement(2, 16, 0, 4, max_ep_size=5)
    assert p.slots_per_rank == 6 and plain.slots_per_rank == 4
    grid = p.phy2log.view(2, 5, 6)
    assert torch.equal(grid[:, :, :4], plain.phy2log.view(2, 5, 4)), "launch slots as before"
    assert bool((grid[:, :, 4:] == 16).all()), "reserved slots start empty"
    assert int(p.replica_counts().sum()) == 2 * 16


def test_death_within_min_ep_size_keeps_every_shape():
    """A death, a rejoin and a scale-up down to min_ep_size ranks change no tensor shape
    of the metadata the CUDA graphs read (the slots and the replica width stay)."""
    from elasticep.eplb.elastic import reconcile_placement, repair_placement, scale_up_placement

    p = initial_placement(3, 16, 0, 4, max_ep_size=6, min_ep_size=3)
    shapes = _shapes(ExpertLocationMetadata.from_placement(p, 0))
    dead = repair_placement(p, torch.tensor([True, False, True, True, False, False]))
    assert dead.slots_per_rank == p.slots_per_rank
    back = reconcile_placement(dead, torch.tensor([True, True, True, True, False, False]))
    up = scale_up_placement(back, torch.ones(6, dtype=torch.bool))
    for q in (dead, back, up):
        assert torch.all(q.replica_counts() >= 1)
        for r in q.live_ranks():
            assert _shapes(ExpertLocationMetadata.from_placement(q, r)) == shapes
    # below min_ep_size the slots must grow (and the shapes change)
    two = repair_placement(dead, torch.tensor([True, False, False, True, False, False]))
    assert two.slots_per_rank == 8


def _shapes(m: ExpertLocationMetadata) -> list[tuple[int, ...]]:
    return [tuple(getattr(m, f).shape) for f in ("physical_to_logical_map",
            "logical_to_all_physical_map", "logical_to_all_physical_map_num_valid",
            "logical_to_rank_dispatch_physical_map")]
