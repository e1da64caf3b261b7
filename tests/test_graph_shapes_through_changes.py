"""What the decode CUDA graphs read keeps its storage through membership changes within
``--min-ep-size`` (issue: zero re-captures on survivors). The CUDA executor bumps its
``version`` (every captured graph then goes stale and is captured again) exactly when a
placement changes a tensor's shape; here its tensors live on the CPU, which the
comparison of shapes does not care about. The graphs replayed across such changes are
checked against eager on the GPU (tests/test_cuda_graph_ep_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from elasticep.eplb.elastic import reconcile_placement, repair_placement, scale_up_placement
from elasticep.eplb.metadata import ExpertLocationMetadata
from elasticep.eplb.placement import Placement, initial_placement
from elasticep.moe.cuda_executor import CudaEPMoEExecutor
from tests._simulated_peers import rank0, rel_err

L, E, H, INTER = 2, 16, 8, 4


def _weights(p: Placement, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    S = p.slots_per_rank
    experts = p.local(rank)  # [L, S], E = empty
    w13 = [(experts[layer].float() + 1).view(S, 1, 1).expand(S, 2 * INTER, H).clone()
           for layer in range(L)]
    w2 = [(experts[layer].float() + 1).view(S, 1, 1).expand(S, H, INTER).clone()
          for layer in range(L)]
    return w13, w2


def _executor(p: Placement, rank: int) -> CudaEPMoEExecutor:
    w13, w2 = _weights(p, rank)
    return CudaEPMoEExecutor(ExpertLocationMetadata.from_placement(p, rank), w13, w2, None)


def _move(ex: CudaEPMoEExecutor, p: Placement) -> None:
    w13, w2 = _weights(p, ex.rank)
    ex.set_placement(ExpertLocationMetadata.from_placement(p, ex.rank), w13, w2)


def test_death_rejoin_and_scale_up_keep_the_version_of_a_survivor():
    mask = lambda *r: torch.tensor([i in r for i in range(6)])  # noqa: E731
    p = initial_placement(L, E, 0, 4, max_ep_size=6, min_ep_size=3)
    ex = _executor(p, 0)
    v, w13 = ex.version, ex.w13[0]
    dead = repair_placement(p, mask(0, 2, 3))
    back = reconcile_placement(dead, mask(0, 1, 2, 3))
    up = scale_up_placement(back, mask(0, 1, 2, 3, 4, 5))
    down = repair_placement(up, mask(0, 1, 2, 3))
    for q in (dead, back, up, down):
        _move(ex, q)
        assert ex.version == v, "a change within --min-ep-size must not change a shape"
        assert ex.w13[0] is w13, "the weights are copied into the captured tensors"
        # the copied-in weights are the new placement's
        want = q.local(0)[0].float() + 1
        assert torch.equal(ex.w13[0][:, 0, 0], want)


def test_below_min_ep_size_the_slots_grow_and_the_version_moves():
    p = initial_placement(L, E, 0, 4, max_ep_size=4, min_ep_size=3)
    ex = _executor(p, 0)
    v = ex.version
    two = repair_placement(p, torch.tensor([True, False, False, True]))
    assert two.slots_per_rank > p.slots_per_rank
    _move(ex, two)
    assert ex.version != v


@pytest.mark.parametrize("redundant", [0, 16])
def test_rank0_through_death_rejoin_and_scale_up_computes_as_at_launch(tmp_path, redundant):
    """The CPU half of tests/test_graph_through_membership_gpu.py: the same placements
    and simulated peers, eagerly. Every placement keeps the executor's ``version`` (its
    tensors' shapes), sends no pair to an inactive rank, and gives the logits of a
    second executor that kept the launch placement (the same experts, elsewhere)."""
    r = rank0(tmp_path, torch.float32, "cpu", redundant, cuda_graph=False)
    version = r.ep.version
    launch = r.placements[0][1]
    ref = r.executor_under(launch)
    r.add_requests(lengths=(5, 17), max_tokens=8)
    for name, p in r.placements[1:]:
        r.move(p)
        assert r.ep.version == version, name
        assert torch.equal(r.ep.metadata.physical_to_logical_map, p.phy2log), name
        for _ in range(2):
            batch = r.next_decode_batch()
            bound = max(batch.num_tokens, 5)
            err = rel_err(r.logits(batch, bound, graph=False),
                          r.logits(batch, bound, graph=False, ex=ref))
            assert err < 1e-5, (name, err)
            r.commit_step(batch, bound)
    dead = dict(r.placements)["death"]
    assert not bool(dead.active_ranks[1]) and bool(dict(r.placements)["scale-up"].active_ranks[3])
    if redundant == 0:  # rank 1's experts had no replica: some now sit in rank 0's reserve
        assert not torch.equal(dead.local(0), launch.local(0))
