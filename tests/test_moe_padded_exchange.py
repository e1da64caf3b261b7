"""CPU tests of the GPU token exchange's layout and of the grouped expert compute.

G ranks are simulated in one process: each rank packs its send buffer, the
all_to_all is a transpose of row blocks, experts run on each rank's slots, and the
combined output must equal the single-rank reference over all experts.
"""

from __future__ import annotations

import pytest
import torch

from elasticep.moe.expert_compute import grouped_swiglu
from elasticep.moe.local_executor import run_slots
from elasticep.moe.padded_exchange import (
    ROW_ALIGN,
    pack,
    pair_capacity,
    plan_padded,
    unpack,
)


def test_capacity_bounds_and_alignment():
    assert pair_capacity(0, 8, 4) == ROW_ALIGN
    assert pair_capacity(5, 8, 4) == 24  # 5 * min(8, 4) = 20 -> 24
    assert pair_capacity(16, 2, 64) == 32
    for bad in ((-1, 2, 2), (1, 0, 2), (1, 2, 0)):
        with pytest.raises(ValueError):
            pair_capacity(*bad)


@pytest.mark.parametrize("seed", range(5))
def test_plan_places_every_pair_once_inside_its_block(seed):
    g = torch.Generator().manual_seed(seed)
    G, S, T, k = 3, 4, 7, 3
    # distinct slots per token, as top-k over distinct experts guarantees
    slots = torch.stack([torch.randperm(G * S, generator=g)[:k] for _ in range(T)])
    C = pair_capacity(T, k, S)
    plan = plan_padded(slots, S, G, C)
    pos = plan.position
    assert pos.unique().numel() == T * k
    assert torch.equal(torch.div(pos, C, rounding_mode="floor"), slots.reshape(-1) // S)
    assert torch.equal(plan.tag.long(), slots.reshape(-1) % S + 1)
    # pairs of one destination keep flat (token, choice) order
    for d in range(G):
        mine = pos[slots.reshape(-1) // S == d]
        assert torch.equal(mine, torch.sort(mine).values)


@pytest.mark.parametrize("dtype,grouped", [(torch.float32, False), (torch.bfloat16, True),
                                           (torch.bfloat16, False)])
def test_simulated_exchange_matches_single_rank_reference(dtype, grouped):
    g = torch.Generator().manual_seed(0)
    G, S, H, inter, k = 2, 4, 32, 16, 2
    w13 = (torch.randn(G * S, 2 * inter, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(G * S, H, inter, generator=g) * 0.2).to(dtype)
    T = [5, 0]  # an idle rank still takes part
    hidden = [torch.randn(t, H, generator=g).to(dtype) for t in T]
    slots = [torch.stack([torch.randperm(G * S, generator=g)[:k] for _ in range(t)])
             if t else torch.empty(0, k, dtype=torch.long) for t in T]
    weights = [torch.rand(t, k, generator=g) for t in T]
    C = pair_capacity(max(T), k, S)
    plans = [plan_padded(s, S, G, C) for s in slots]
    sent = [pack(h, k, p) for h, p in zip(hidden, plans, strict=True)]
    # all_to_all: rank d receives block d of every sender, in sender order
    recv = [(torch.cat([sent[s][0][d * C:(d + 1) * C] for s in range(G)]),
             torch.cat([sent[s][1][d * C:(d + 1) * C] for s in range(G)])) for d in range(G)]
    outs = [grouped_swiglu(w13[d * S:(d + 1) * S], w2[d * S:(d + 1) * S], r, t,
                           use_grouped=grouped) for d, (r, t) in enumerate(recv)]
    for d, (_, t) in enumerate(recv):  # padding rows come back as zeros
        assert torch.count_nonzero(outs[d][t == 0]) == 0
    back = [torch.cat([outs[d][s * C:(s + 1) * C] for d in range(G)]) for s in range(G)]
    for r in range(G):
        pairs = unpack(back[r], plans[r]).view(T[r], k, H).float()
        got = (pairs * weights[r].unsqueeze(-1)).sum(1)
        ref = run_slots(w13.float(), w2.float(), hidden[r].float(), slots[r], weights[r])
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert got.shape == ref.shape
        if T[r]:
            err = (got - ref).norm() / ref.norm()
            assert err < tol, err
