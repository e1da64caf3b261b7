"""Placement changes that copy experts from the peers' mapped tensors (``peers`` of
:func:`elasticep.moe.weight_transfer.move_expert_weights`), simulated in one process.

Also the order :func:`elasticep.elastic.placement_sync.commit_placement` keeps around
the peers: a change that fails in its move or its commit ends the peers' change and
leaves the executor as it was; one that commits ends it, swaps, then publishes.

Every rank of a deployment is a pair of per-layer tensors whose slots carry the id of
the expert they hold; after a death, a scale-down, a scale-up and a rebalance, each
rank's new slots must hold exactly the experts the new placement puts there, with no
collective at all (no process group exists in this process), and a source that cannot
be read must leave only its own slots empty. A dead rank's orphans come from its
still-mapped tensors, or from the checkpoint where it is not mapped.
"""

from __future__ import annotations

import random

import pytest
import torch

from elasticep.elastic import placement_sync
from elasticep.eplb.elastic import (
    plan_expert_loads,
    repair_placement,
    scale_down_placement,
    scale_up_placement,
)
from elasticep.eplb.metadata import ExpertLocationMetadata
from elasticep.eplb.placement import Placement, initial_placement
from elasticep.eplb.rebalance import rebalance_placement
from elasticep.membership.errors import RankFailureError
from elasticep.moe.ep_executor import EPMoEExecutor
from elasticep.moe.peer_weights import PeerWeights
from elasticep.moe.weight_transfer import PeerUnavailable, move_expert_weights

ROWS13, H, INTER = 6, 3, 3  # w13 [S, 2*I, H], w2 [S, H, I]


def _weights(p: Placement, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Slot j of layer l holds (1000*l + expert + 1) everywhere; EMPTY slots hold 0."""
    local = p.local(rank)
    w13, w2 = [], []
    for layer in range(p.num_layers):
        ids = local[layer].to(torch.float32)
        val = torch.where(local[layer] == p.empty, 0.0, 1000.0 * layer + ids + 1)
        w13.append(val.view(-1, 1, 1).expand(-1, ROWS13, H).clone())
        w2.append(-val.view(-1, 1, 1).expand(-1, H, INTER).clone())
    return w13, w2


def _check(p: Placement, rank: int, w13: list[torch.Tensor], w2: list[torch.Tensor],
           skip: set[tuple[int, int]] = frozenset()) -> None:
    local = p.local(rank)
    for layer in range(p.num_layers):
        for j, e in enumerate(local[layer].tolist()):
            if e == p.empty:
                continue
            want = 0.0 if (layer, j) in skip else 1000.0 * layer + e + 1
            assert torch.all(w13[layer][j] == want), (rank, layer, j, e)
            assert torch.all(w2[layer][j] == -want), (rank, layer, j, e)


def _move_all(old: Placement, new: Placement, source_ranks: torch.Tensor | None = None,
              dead_mapped: bool = True):
    """Every rank active in ``new`` moves with peers = the other ranks' old tensors (a
    dead rank's too where ``dead_mapped``). Returns ``{rank: (w13, w2, loads, peers)}``."""
    weights = {r: _weights(old, r) for r in old.live_ranks()}
    plan = plan_expert_loads(old, new, source_ranks)
    out = {}
    for r in new.live_ranks():
        w13, w2 = weights.get(r) or _weights(_nothing(old), r)
        peers = PeerWeights(r)
        peers.map_local({q: w for q, w in weights.items()
                         if q != r and (dead_mapped or bool(new.active_ranks[q]))})
        out[r] = (*move_expert_weights(plan, old, new, r, w13, w2, group=None,
                                       load_fn=_checkpoint, peers=peers), plan, peers)
    return out


def _nothing(p: Placement) -> Placement:
    return Placement(torch.full_like(p.phy2log, p.empty), p.num_logical_experts,
                     p.slots_per_rank, torch.zeros_like(p.active_ranks))


def _checkpoint(layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    v = 1000.0 * layer + expert + 1
    return torch.full((ROWS13, H), v), torch.full((H, INTER), -v)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("change", ["death", "scale_down", "scale_up", "rebalance"])
def test_every_rank_ends_with_the_experts_of_the_new_placement(seed, change):
    rnd = random.Random(seed)
    E, N = rnd.choice([8, 12]), rnd.choice([2, 3, 4])
    R = rnd.choice([0, E // 2])
    old = initial_placement(2, E, R, N, max_ep_size=N + 2)
    source = None
    if change == "death":
        mask = old.active_ranks.clone()
        mask[rnd.randrange(N)] = False
        new = repair_placement(old, mask)
    elif change == "scale_down":
        leaving = [rnd.randrange(N)]
        new, source = scale_down_placement(old, leaving), old.active_ranks
    elif change == "scale_up":
        new = scale_up_placement(old, torch.ones(N + 2, dtype=torch.bool))
    else:
        weight = torch.rand(2, E, generator=torch.Generator().manual_seed(seed)) ** 4 * 1000
        new = rebalance_placement(weight, old)
    moved = _move_all(old, new, source)
    for r, (w13, w2, loads, peers) in moved.items():
        _check(new, r, w13, w2)
        assert all(t.shape[0] == new.slots_per_rank for t in w13 + w2)
        # a dead rank's orphans come from its mapped tensors, none from the checkpoint
        orphans = sum(x.rank == r and x.source_rank is None for x in loads)
        assert peers.departed_copies == orphans
    peer = [x for x in moved[new.live_ranks()[0]][2] if x.source_rank not in (None, x.rank)]
    if change == "scale_up" or (change == "scale_down" and R == 0):
        assert peer, "the change should move experts between ranks"


class _Flaky(PeerWeights):
    """A peer view whose rank ``gone`` cannot be read (its process died)."""

    def __init__(self, rank: int, gone: int) -> None:
        super().__init__(rank)
        self.gone = gone

    def experts(self, rank: int, layer: int):
        if rank == self.gone:
            raise PeerUnavailable(f"rank {rank} is gone")
        return super().experts(rank, layer)


def test_an_unreadable_source_leaves_only_its_own_slots_empty(caplog):
    old = initial_placement(2, 8, 0, 2, max_ep_size=4)
    new = scale_up_placement(old, torch.ones(4, dtype=torch.bool))
    weights = {r: _weights(old, r) for r in (0, 1)}
    w13, w2 = _weights(_nothing(old), 2)
    peers = _Flaky(2, gone=1)
    peers.map_local(weights)
    loads = plan_expert_loads(old, new)
    with caplog.at_level("WARNING"):
        n13, n2 = move_expert_weights(loads, old, new, 2, w13, w2, group=None, peers=peers)
    from_gone = {(x.layer, x.local_slot) for x in loads if x.rank == 2 and x.source_rank == 1}
    assert from_gone and any(x.rank == 2 and x.source_rank == 0 for x in loads)
    _check(new, 2, n13, n2, skip=from_gone)
    assert "ranks [1] cannot be read" in caplog.text


def test_orphans_of_an_unmapped_dead_rank_come_from_the_checkpoint():
    old = initial_placement(2, 8, 0, 3, max_ep_size=3)
    mask = torch.tensor([True, False, True])
    new = repair_placement(old, mask)
    moved = _move_all(old, new, dead_mapped=False)
    orphans = 0
    for r, (w13, w2, loads, peers) in moved.items():
        _check(new, r, w13, w2)
        orphans += sum(x.rank == r and x.source_rank is None for x in loads)
        assert peers.departed_copies == 0
    assert orphans > 0


def test_publish_without_a_store_is_a_no_op():
    p = PeerWeights(0)
    assert p.publish([torch.zeros(1)], [torch.zeros(1)]) == 0
    with pytest.raises(PeerUnavailable, match="not mapped"):
        p.experts(1, 0)


class _Recording(PeerWeights):
    """A peer view that records the change's calls into it."""

    def __init__(self, rank: int, events: list[str]) -> None:
        super().__init__(rank)
        self.events = events

    def end_change(self) -> None:
        self.events.append("end_change")
        super().end_change()

    def publish(self, w13, w2) -> int:
        self.events.append(f"publish {w13[0][0, 0, 0]:.0f}")
        return super().publish(w13, w2)


@pytest.mark.parametrize("fails", [None, "move", "commit"])
def test_commit_placement_ends_the_change_then_swaps_then_publishes(monkeypatch, fails):
    old = initial_placement(1, 4, 0, 1)
    new = Placement(old.phy2log.flip(1), 4, old.slots_per_rank, old.active_ranks)
    w13, w2 = _weights(old, 0)
    ep = EPMoEExecutor(ExpertLocationMetadata.from_placement(old, 0), w13, w2, group=None)
    events: list[str] = []
    ep.peer_weights = _Recording(0, events)

    def commit(group) -> None:  # one rank: no collective to agree in
        if fails == "commit":
            raise RankFailureError([1], epoch=2)  # a peer died before the commit
        events.append("commit")

    monkeypatch.setattr(placement_sync, "_commit", commit)
    if fails is None:
        report = placement_sync.commit_placement(ep, new, None, None)
        assert events == ["commit", "end_change", "publish 4"]  # the new slot 0: expert 3
        assert ep.placement == new
        _check(new, 0, ep.w13, ep.w2)
        assert (report.changed, report.peer_copies, report.reloads) == (True, 0, 0)
        return
    # the move fails before any collective: every expert is an orphan, and no loader
    nothing = _nothing(old) if fails == "move" else None
    with pytest.raises(ValueError if fails == "move" else RankFailureError):
        placement_sync.commit_placement(ep, new, None, None, weights_from=nothing)
    assert events == ["end_change"]
    assert ep.placement == old and ep.w13[0] is w13[0] and ep.w2[0] is w2[0]
