"""CPU tests of the GPU token exchange's layout and of the grouped expert compute.

G ranks are simulated in one process: each rank packs its send buffer, the
all_to_all is a transpose of row blocks, experts run on each rank's slots, and the
combined output must equal the single-rank reference over all experts.
"""

from __future__ import annotations

import pytest
import torch

from elasticep.moe.exchange.padded_exchange import (
    ROW_ALIGN,
    pack,
    pair_capacity,
    plan_padded,
    row_width,
    split_rows,
)
from elasticep.moe.exchange.pair_combine import combine_pairs
from elasticep.moe.experts.expert_compute import grouped_swiglu
from elasticep.moe.local_executor import run_slots


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
    assert sent[0].shape == (G * C, row_width(H, dtype))
    assert (sent[0].shape[1] * sent[0].element_size()) % 16 == 0
    # all_to_all: rank d receives block d of every sender, in sender order
    recv = [split_rows(torch.cat([sent[s][d * C:(d + 1) * C] for s in range(G)]), H)
            for d in range(G)]
    outs = [grouped_swiglu(w13[d * S:(d + 1) * S], w2[d * S:(d + 1) * S], r, t,
                           use_grouped=grouped) for d, (r, t) in enumerate(recv)]
    for d, (_, t) in enumerate(recv):  # padding rows come back as zeros
        assert torch.count_nonzero(outs[d][t == 0]) == 0
    back = [torch.cat([outs[d][s * C:(s + 1) * C] for d in range(G)]) for s in range(G)]
    for r in range(G):
        pairs = back[r][plans[r].position].view(T[r], k, H).float()  # flat pair order
        got = (pairs * weights[r].unsqueeze(-1)).sum(1)
        # the combine reads the rows in place, in the exchange's layout
        assert torch.equal(combine_pairs(back[r], weights[r], torch.float32,
                                         rows=plans[r].position), got)
        ref = run_slots(w13.float(), w2.float(), hidden[r].float(), slots[r], weights[r])
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert got.shape == ref.shape
        if T[r]:
            err = (got - ref).norm() / ref.norm()
            assert err < tol, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_slots_path_equals_per_slot_loop(dtype):
    """The sync-free path (every slot over every row, then each row's own) against the
    per-slot loop, with padding rows; and it writes into the given buffer."""
    g = torch.Generator().manual_seed(3)
    S, N, H, inter = 5, 23, 16, 12
    w13 = (torch.randn(S, 2 * inter, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(S, H, inter, generator=g) / inter**0.5).to(dtype)
    rows = torch.randn(N, H, generator=g).to(dtype)
    tags = torch.randint(0, S + 1, (N,), generator=g, dtype=torch.int32)  # 0 = padding
    ref = grouped_swiglu(w13, w2, rows, tags, use_grouped=False)
    buf = torch.full((N, H), 7.0, dtype=dtype)
    got = grouped_swiglu(w13, w2, rows, tags, use_grouped=False, sync_free=True, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    assert bool((got[tags == 0] == 0).all()) and bool((tags == 0).any())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((got.float() - ref.float()).abs().max()) <= tol * float(ref.abs().max())


def test_a_tag_bound_reads_each_block_clamped_and_leaves_the_tags_as_they_are():
    """``tag_bound`` (the same-host exchange's per-source clamp, deferred to the expert
    compute): out-of-range tags of an active source read as S, every tag of an inactive
    source as padding; the received tags themselves are not rewritten."""
    g = torch.Generator().manual_seed(4)
    S, C, H, inter = 3, 6, 16, 8
    w13 = torch.randn(S, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(S, H, inter, generator=g) / inter**0.5
    rows = torch.randn(2 * C, H, generator=g)
    tags = torch.tensor([1, 9, 0, 3, -2, 2, 1, 2, 3, 40, 0, 1], dtype=torch.int32)
    bound = torch.tensor([[S], [0]], dtype=torch.int32)  # source 1 is inactive
    raw = tags.clone()
    got = grouped_swiglu(w13, w2, rows, tags, use_grouped=False, sync_free=True,
                         tag_bound=(bound, C))
    assert torch.equal(tags, raw)
    want_tags = torch.tensor([1, 3, 0, 3, -2, 2] + [0] * C, dtype=torch.int32)
    ref = grouped_swiglu(w13, w2, rows, want_tags, use_grouped=False)
    assert torch.allclose(got, ref, atol=1e-6)
    assert bool((got[C:] == 0).all())


def test_exchange_buffers_grow_only_when_allowed():
    from elasticep.moe.exchange.padded_exchange import ExchangeBuffers

    allowed = [False]
    bufs = ExchangeBuffers(lambda: allowed[0])
    like = torch.zeros(1, 4)
    a = bufs("rows", 8, like)
    assert bufs.generation == 0 and bufs.nbytes == 0  # not kept: a fresh tensor
    allowed[0] = True
    b = bufs("rows", 8, like)
    assert bufs.generation == 1 and bufs.nbytes == 8 * 4 * 4 and a.data_ptr() != b.data_ptr()
    allowed[0] = False
    assert bufs("rows", 5, like).data_ptr() == b.data_ptr()  # a view of the kept buffer
    big = bufs("rows", 9, like)  # larger than kept, growth not allowed: fresh, kept stays
    assert big.shape == (9, 4) and big.data_ptr() != b.data_ptr() and bufs.generation == 1
    assert bufs("rows", 8, torch.zeros(1, 4, dtype=torch.float64)).dtype == torch.float64
    assert bufs.generation == 1


def test_cuda_ep_executor_copies_a_same_shape_placement_in_place():
    """Graphs captured over the executor keep their tensors when the new placement has
    the same shapes; a placement with more slots per rank bumps ``version``."""
    from elasticep.eplb.metadata import ExpertLocationMetadata
    from elasticep.eplb.placement import Placement, initial_placement
    from elasticep.moe.cuda_executor import CudaEPMoEExecutor

    L, E, H, inter = 2, 4, 8, 6
    p = initial_placement(L, E, 0, 1, 1)
    S = p.slots_per_rank
    w13 = [torch.randn(S, 2 * inter, H) for _ in range(L)]
    w2 = [torch.randn(S, H, inter) for _ in range(L)]
    ex = CudaEPMoEExecutor(ExpertLocationMetadata.from_placement(p, 0), w13, w2, None)
    v, ptr13, ptr_map = ex.version, ex.w13[0].data_ptr(), \
        ex.metadata.logical_to_rank_dispatch_physical_map.data_ptr()
    perm = p.phy2log.flip(1)
    q = Placement(perm, E, S, p.active_ranks)
    new13 = [w.flip(0).clone() for w in w13]
    ex.set_placement(ExpertLocationMetadata.from_placement(q, 0), new13, [w.flip(0) for w in w2])
    assert ex.version == v and ex.w13[0].data_ptr() == ptr13
    assert ex.metadata.logical_to_rank_dispatch_physical_map.data_ptr() == ptr_map
    assert torch.equal(ex.w13[0], new13[0]) and torch.equal(ex.placement.phy2log, perm)
    assert torch.equal(ex.metadata.logical_to_rank_dispatch_physical_map,
                       ExpertLocationMetadata.from_placement(q, 0).logical_to_rank_dispatch_physical_map)
    r = initial_placement(L, E, 2, 1, 1)  # two more slots per rank: new shapes
    ex.set_placement(ExpertLocationMetadata.from_placement(r, 0),
                     [torch.randn(S + 2, 2 * inter, H) for _ in range(L)],
                     [torch.randn(S + 2, H, inter) for _ in range(L)])
    assert ex.version == v + 1 and ex.w13[0].shape[0] == S + 2
