"""EP executor on 4 Gloo ranks (spawned processes) against a dense single-process reference.

One launch runs every scenario (the processes are the expensive part on 2 cores); each
test then checks one scenario's saved outputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from elasticep_testkit.ep import finish_gloo_rank, init_gloo_rank, run_gloo_ranks

WORLD, E, H, INTER, K, LAYERS, T = 4, 8, 16, 8, 2, 3, 6  # decoder layer 0 is dense
MOE_LAYERS = (1, 2)
HANG_BOUND_S = 60


def _logical_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return (
        torch.randn(LAYERS, E, 2 * INTER, H, generator=g) * 0.3,
        torch.randn(LAYERS, E, H, INTER, generator=g) * 0.3,
    )


def _tokens(rank: int, n: int = T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(n, H, generator=g)
    logits = torch.randn(n, E, generator=g)
    vals, ids = torch.topk(logits.softmax(-1), K, dim=-1)
    return hidden, ids, (vals / vals.sum(-1, keepdim=True)).float()


def _reference(layer: int, hidden, ids, weights) -> torch.Tensor:
    w13, w2 = _logical_weights()
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(hidden[t], w13[layer, e]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, w2[layer, e])
    return out


def _local_weights(placement, rank):
    w13, w2 = _logical_weights()
    a, b = [None], [None]
    for layer in MOE_LAYERS:
        idx = placement.local(rank)[layer]
        keep = (idx < E).view(-1, 1, 1)
        a.append(w13[layer][idx.clamp(max=E - 1)] * keep)
        b.append(w2[layer][idx.clamp(max=E - 1)] * keep)
    return a, b


def _checkpoint(layer: int, expert: int):
    w13, w2 = _logical_weights()
    return w13[layer, expert], w2[layer, expert]


def _worker(rank: int, port: int, outdir: str) -> None:
    from elasticep.elastic.placement_sync import commit_placement
    from elasticep.eplb import (
        EPLBConfig,
        EPLBManager,
        ExpertLocationMetadata,
        broadcast_global_expert_location_metadata,
        initial_placement,
        plan_expert_loads,
        rebalance_placement,
        repair_placement,
        scale_down_placement,
        scale_up_placement,
    )
    from elasticep.moe.ep_executor import EPMoEExecutor

    init_gloo_rank(rank, port, WORLD)
    results: dict[str, object] = {}

    def run(name, ex, dtype=torch.float32):
        n = T if bool(ex.placement.active_ranks[rank]) else 0  # a hole has no tokens
        hidden, ids, w = _tokens(rank, n)
        results[name] = [ex(layer, hidden.to(dtype), ids, w) for layer in MOE_LAYERS]

    def fresh(placement, algo, dtype=torch.float32):
        meta = ExpertLocationMetadata.from_placement(placement, rank)
        a, b = _local_weights(placement, rank)
        a = [None if x is None else x.to(dtype) for x in a]
        b = [None if x is None else x.to(dtype) for x in b]
        return EPMoEExecutor(meta, a, b, group=None, dispatch_algorithm=algo)

    p0 = initial_placement(LAYERS, E, 0, WORLD)
    p4 = initial_placement(LAYERS, E, 4, WORLD)
    hole = torch.tensor([True, True, False, True])
    run("r0_static", fresh(p0, "static"))
    run("r0_dynamic", fresh(p0, "dynamic"))
    run("r4_static", fresh(p4, "static"))
    run("r4_dynamic", fresh(p4, "dynamic"))
    run("hole_r4_static", fresh(repair_placement(p4, hole), "static"))
    run("hole_r4_dynamic", fresh(repair_placement(p4, hole), "dynamic"))
    run("bf16_r4_dynamic", fresh(p4, "dynamic", torch.bfloat16), torch.bfloat16)

    # Weights move through placement_sync.commit_placement (plan, move, commit, swap):
    # orphan reload, scale-up from peers, rebalance, drain.
    def change(ex, new, name, load_fn=None, source_ranks=None):
        plan = plan_expert_loads(ex.placement, new, source_ranks)
        results[name + "_loads"] = [(x.rank, x.source_rank) for x in plan
                                    if x.layer in MOE_LAYERS]
        report = commit_placement(ex, new, None, load_fn, source_ranks)
        results[name + "_report"] = dataclasses.astuple(report)  # plain data for torch.load

    ex = fresh(p0, "static")
    change(ex, repair_placement(p0, hole), "repair", load_fn=_checkpoint)
    results["repair_spr"] = ex.placement.slots_per_rank
    run("repaired_r0", ex)
    change(ex, scale_up_placement(ex.placement, torch.ones(WORLD, dtype=torch.bool)), "scale_up")
    run("scaled_up", ex)
    skew = torch.arange(E, dtype=torch.float64).pow(3).expand(LAYERS, E).contiguous()
    ex.dispatch_algorithm = "dynamic"
    change(ex, rebalance_placement(skew, ex.placement), "rebalance")
    run("rebalanced", ex)
    # Planned scale-down: rank 3 drains; it is still alive, so peers copy from it.
    change(ex, scale_down_placement(ex.placement, [3]), "scale_down",
           source_ranks=ex.placement.active_ranks)
    run("scaled_down", ex)

    # EPLB: each rank counts its own tokens; summed over the group, all agree.
    mgr = EPLBManager(LAYERS, E, EPLBConfig(enabled=True, rebalance_num_iterations=1), rank=rank)
    _, ids, _ = _tokens(rank)
    for layer in MOE_LAYERS:
        mgr.record(layer, ids)
    assert mgr.step()
    results["eplb"] = mgr.rebalance(p4, sync=True).placement.phy2log

    # Broadcast from a healthy non-zero rank; the others hold nothing.
    src_meta = ExpertLocationMetadata.from_placement(ex.placement, rank) if rank == 1 else None
    got = broadcast_global_expert_location_metadata(src_meta, 1, None, rank)
    results["bcast"] = (got.physical_to_logical_map_cpu, got.ep_rank, ex.placement.phy2log)
    finish_gloo_rank(results, rank, outdir)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return run_gloo_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("ep")), HANG_BOUND_S)


# scenario -> the rank that is a hole (inactive, no tokens) in it, if any.
SCENARIOS = {
    "r0_static": None, "r0_dynamic": None, "r4_static": None, "r4_dynamic": None,
    "hole_r4_static": 2, "hole_r4_dynamic": 2, "bf16_r4_dynamic": None, "repaired_r0": 2,
    "scaled_up": None, "rebalanced": None, "scaled_down": 3,
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ep_matches_dense_reference(outputs, name):
    bf16 = name.startswith("bf16")
    for rank in range(WORLD):
        got = outputs[rank][name]
        if rank == SCENARIOS[name]:
            assert all(o.shape == (0, H) for o in got)
            continue
        hidden, ids, w = _tokens(rank)
        for layer, out in zip(MOE_LAYERS, got, strict=True):
            assert out.dtype == (torch.bfloat16 if bf16 else torch.float32)
            tol = 5e-2 if bf16 else 1e-5
            torch.testing.assert_close(out.float(), _reference(layer, hidden, ids, w), rtol=tol, atol=tol)


def _reports(outputs, name):
    from elasticep.elastic.placement_sync import ChangeReport

    return [ChangeReport(*outputs[r][name + "_report"]) for r in range(WORLD)]


def test_repair_without_redundancy_reloads_orphans_and_grows(outputs):
    loads = outputs[0]["repair_loads"]
    # Rank 2 held 2 experts in each of 2 MoE layers; all four are checkpoint reloads.
    assert len(loads) == 4 and all(src is None and dst != 2 for dst, src in loads)
    assert outputs[0]["repair_spr"] == 3  # 3 survivors x 2 slots cannot hold 8 experts
    reports = _reports(outputs, "repair")
    assert [r.reloads for r in reports] == [sum(d == r for d, _ in loads) for r in range(WORLD)]
    assert all(r.changed and r.peer_copies == 0 and r.departed_copies == 0
               and r.slots_per_rank == 3 for r in reports)


def test_scale_up_copies_from_peers(outputs):
    loads = outputs[0]["scale_up_loads"]
    assert loads and all(s is not None for _, s in loads)
    assert [r.peer_copies for r in _reports(outputs, "scale_up")] == [
        sum(d == r and s != r for d, s in loads) for r in range(WORLD)]
    assert all(r.reloads == 0 for r in _reports(outputs, "scale_up"))


def test_rebalance_reports_its_moves(outputs):
    loads = outputs[0]["rebalance_loads"]
    reports = _reports(outputs, "rebalance")
    assert sum(r.peer_copies for r in reports) == sum(s != d for d, s in loads) > 0
    assert all(r.changed and r.reloads == 0 for r in reports)


def test_scale_down_copies_from_leaving_rank(outputs):
    loads = outputs[0]["scale_down_loads"]
    assert loads and 3 in (s for _, s in loads) and None not in (s for _, s in loads)
    reports = _reports(outputs, "scale_down")
    assert [r.peer_copies for r in reports] == [
        sum(d == r and s != r for d, s in loads) for r in range(WORLD)]
    assert reports[3].peer_copies == 0 and all(r.reloads == 0 for r in reports)


def test_eplb_rebalance_is_the_global_loads_on_every_rank(outputs):
    """Every rank derives the placement of the global load: every rank's top-k ids of
    each MoE layer, counted here, rebalanced over EP4 with 4 redundant slots."""
    from elasticep.eplb import initial_placement, rebalance_placement

    counts = torch.zeros(LAYERS, E, dtype=torch.int64)
    for rank in range(WORLD):
        ids = _tokens(rank)[1]
        for layer in MOE_LAYERS:
            counts[layer] += torch.bincount(ids.reshape(-1), minlength=E)
    p4 = initial_placement(LAYERS, E, 4, WORLD)
    expected = rebalance_placement(counts, p4).phy2log
    assert not torch.equal(expected, p4.phy2log)  # the load moves experts: not a no-op
    for r in range(WORLD):
        assert torch.equal(outputs[r]["eplb"], expected), r


def test_broadcast_from_healthy_rank(outputs):
    ref = outputs[1]["bcast"][2]
    for rank in range(WORLD):
        phy2log, ep_rank, _ = outputs[rank]["bcast"]
        assert torch.equal(phy2log, ref) and ep_rank == rank
