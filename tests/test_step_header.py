"""The step loop's header agrees on each step's largest batch, and the CUDA executor
uses that bound instead of a per-layer all_reduce.

* :func:`step_header` / :func:`parse_header`: the SUM of every rank's header gives the
  per-rank token counts and their max (simulated SUM, no processes).
* :class:`LockstepLoop`: one iteration over a fake 2-rank group (``dist.all_reduce``
  replaced by "add the peer's header") sets ``ep.step_max_tokens`` to the agreed max
  during ``execute`` only, on a busy and on an idle rank.
* :class:`CudaEPMoEExecutor` on CPU tensors over 2 spawned Gloo ranks: with
  ``step_max_tokens`` set it runs no all_reduce and returns exactly what it returns
  when the bound is agreed per layer, which matches the CPU :class:`EPMoEExecutor`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _loop_fakes import fake_loop

from elasticep.elastic.step_header import (
    agreed_max_tokens,
    parse_header,
    step_header,
)
from elasticep_testkit.ep import finish_gloo_rank, init_gloo_rank, run_gloo_ranks

HANG_BOUND_S = 60


# ---------------------------------------------------------------------- pure header
def _votes(M: int, ones: tuple[int, ...] = ()) -> torch.Tensor:
    v = torch.zeros(M, dtype=torch.int64)
    v[list(ones)] = 1
    return v


def test_summed_headers_give_every_ranks_tokens_and_the_max():
    M = 4  # slot 2 is a hole: contributes nothing
    contrib = [
        step_header(1, _votes(M), _votes(M), 0, 7),
        step_header(0, _votes(M, (3,)), _votes(M), 1, 0),  # idle rank, voted to admit 3
        step_header(1, _votes(M, (3,)), _votes(M, (1,)), 3, 12),
    ]
    assert [c.shape for c in contrib] == [torch.Size([1 + 3 * M])] * 3
    assert contrib[0].tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0]
    h = parse_header(torch.stack(contrib).sum(0), M)
    assert h.work == 2
    assert h.admit == [3]
    assert h.remove == [1]
    assert h.tokens == [7, 0, 0, 12]
    assert h.max_tokens == 12


def test_all_idle_header_has_zero_bound():
    M = 2
    h = parse_header(step_header(0, _votes(M), _votes(M), 0, 0)
                     + step_header(0, _votes(M), _votes(M), 1, 0), M)
    assert (h.work, h.admit, h.remove, h.tokens, h.max_tokens) == (0, [], [], [0, 0], 0)


def test_header_rejects_bad_rank_and_size():
    with pytest.raises(ValueError):
        step_header(1, _votes(2), _votes(2), 2, 1)
    with pytest.raises(ValueError):
        parse_header(torch.zeros(1 + 2 * 2, dtype=torch.int64), 2)


def test_agreed_max_tokens_sets_and_restores_only_where_supported():
    cuda_like = SimpleNamespace(step_max_tokens=None, uses_step_bound=True)
    with agreed_max_tokens(cuda_like, 9):
        assert cuda_like.step_max_tokens == 9
    assert cuda_like.step_max_tokens is None
    with pytest.raises(RuntimeError), agreed_max_tokens(cuda_like, 3):
        raise RuntimeError("a failed step")
    assert cuda_like.step_max_tokens is None
    cpu_like = SimpleNamespace(step_max_tokens=None, uses_step_bound=False)
    with agreed_max_tokens(cpu_like, 9):
        assert cpu_like.step_max_tokens is None


# ---------------------------------------------------------------------- one iteration
def _run_one_iteration(monkeypatch, rank: int, mine: list[int], peer_tokens: int):
    """One iteration of ``rank`` of 2 with one batch of ``mine`` sequences' tokens, the
    peer having ``peer_tokens`` scheduled."""
    loop, engine, calls = fake_loop(monkeypatch, rank, [mine] if mine else [], peer_tokens)
    loop.step()
    return engine, loop.ep, loop, calls


def test_iteration_sets_the_agreed_bound_for_execute_only(monkeypatch):
    engine, ep, loop, calls = _run_one_iteration(monkeypatch, 0, [3, 1], peer_tokens=9)
    assert engine.executed == [(4, 9)]
    assert ep.step_max_tokens is None
    assert loop.pending is None and loop.stats.steps == 1
    assert calls == [7, 2]  # header, commit ([step, aborted]): no per-layer collective

    engine, ep, loop, _ = _run_one_iteration(monkeypatch, 1, [6], peer_tokens=2)
    assert engine.executed == [(6, 6)]  # its own batch is the largest


def test_idle_rank_forwards_empty_batch_under_the_peers_bound(monkeypatch):
    engine, ep, loop, _ = _run_one_iteration(monkeypatch, 1, [], peer_tokens=5)
    assert engine.executed == [(0, 5)]
    assert ep.step_max_tokens is None


def test_nobody_has_work_executes_nothing(monkeypatch):
    engine, ep, loop, calls = _run_one_iteration(monkeypatch, 0, [], peer_tokens=0)
    assert engine.executed == []
    assert calls == [7]


# ---------------------------------------------------------------------- CUDA executor on CPU
WORLD, E, H, INTER, K, LAYERS = 2, 4, 16, 8, 2, 3
MOE_LAYERS = (1, 2)
TOKENS = (5, 0)  # rank 1 is idle and still takes part


def _weights():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(LAYERS, E, 2 * INTER, H, generator=g) * 0.3,
            torch.randn(LAYERS, E, H, INTER, generator=g) * 0.3)


def _worker(rank: int, port: int, outdir: str) -> None:
    from elasticep.eplb import ExpertLocationMetadata, initial_placement
    from elasticep.moe.cuda_executor import CudaEPMoEExecutor
    from elasticep.moe.ep_executor import EPMoEExecutor

    init_gloo_rank(rank, port, WORLD)
    placement = initial_placement(LAYERS, E, 2, WORLD)  # 3 slots per rank, 2 replicas
    meta = ExpertLocationMetadata.from_placement(placement, rank)
    w13, w2 = _weights()
    local = placement.local(rank)
    a = [None] + [w13[layer][local[layer]] for layer in MOE_LAYERS]
    b = [None] + [w2[layer][local[layer]] for layer in MOE_LAYERS]
    g = torch.Generator().manual_seed(100 + rank)
    n = TOKENS[rank]
    hidden = torch.randn(n, H, generator=g)
    vals, ids = torch.topk(torch.randn(n, E, generator=g).softmax(-1), K, dim=-1)
    weights = (vals / vals.sum(-1, keepdim=True)).float()

    real_all_reduce = dist.all_reduce
    counted = []

    def counting(*args, **kwargs):
        counted.append(1)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    results = {}
    for algo in ("static", "dynamic"):
        cuda_ex = CudaEPMoEExecutor(meta, a, b, None, dispatch_algorithm=algo)
        counted.clear()
        results[f"{algo}_per_layer"] = [cuda_ex(layer, hidden, ids, weights) for layer in MOE_LAYERS]
        results[f"{algo}_per_layer_reduces"] = len(counted)
        counted.clear()
        cuda_ex.step_max_tokens = max(TOKENS)
        results[f"{algo}_bound"] = [cuda_ex(layer, hidden, ids, weights) for layer in MOE_LAYERS]
        results[f"{algo}_bound_reduces"] = len(counted)
        cuda_ex.step_max_tokens = max(TOKENS) + 11  # a looser bound: same result
        results[f"{algo}_loose"] = [cuda_ex(layer, hidden, ids, weights) for layer in MOE_LAYERS]
        cpu_ex = EPMoEExecutor(meta, a, b, None, dispatch_algorithm=algo)
        results[f"{algo}_cpu"] = [cpu_ex(layer, hidden, ids, weights) for layer in MOE_LAYERS]
    cuda_ex.step_max_tokens = n - 1 if n else None
    if n:
        try:  # raised before any collective, so the peer is not left waiting
            cuda_ex(1, hidden, ids, weights)
            results["too_many"] = "no error"
        except ValueError as exc:
            results["too_many"] = str(exc)
    dist.all_reduce = real_all_reduce
    finish_gloo_rank(results, rank, outdir)


@pytest.fixture(scope="module")
def cuda_executor_outputs(tmp_path_factory):
    return run_gloo_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("cudaep")), HANG_BOUND_S)


@pytest.mark.parametrize("algo", ["static", "dynamic"])
def test_cuda_executor_with_step_bound_skips_all_reduce_and_matches(cuda_executor_outputs, algo):
    for rank, res in enumerate(cuda_executor_outputs):
        assert res[f"{algo}_per_layer_reduces"] == len(MOE_LAYERS)
        assert res[f"{algo}_bound_reduces"] == 0
        for per_layer, bound, loose, cpu in zip(res[f"{algo}_per_layer"], res[f"{algo}_bound"],
                                                res[f"{algo}_loose"], res[f"{algo}_cpu"],
                                                strict=True):
            assert per_layer.shape == (TOKENS[rank], H)
            assert torch.equal(bound, per_layer)
            assert torch.equal(loose, per_layer)
            torch.testing.assert_close(bound, cpu, rtol=1e-5, atol=1e-6)
            if TOKENS[rank]:
                assert per_layer.abs().sum() > 0


def test_cuda_executor_refuses_more_tokens_than_the_bound(cuda_executor_outputs):
    assert "5 tokens > step_max_tokens 4" in cuda_executor_outputs[0]["too_many"]


@pytest.mark.parametrize("defer", [True, False])
def test_outputs_go_out_while_the_next_forward_runs(monkeypatch, defer):
    # deferred (the in-graph exchange): step i's outputs are sent after step i+1's
    # forward is launched and before it ends; the last step's when the group goes idle.
    # Otherwise each step's right after its commit.
    loop, engine, _ = fake_loop(monkeypatch, 0, [[1], [1], [1]], peer_tokens=0,
                                defer_publish=defer)
    for _ in range(3):
        loop.step()
    if defer:
        assert loop._unsent is not None  # step 3's outputs wait for a forward or idleness
    loop.step()  # nobody has work: sends what is left
    assert loop._unsent is None
    ev = [e[:2] for e in engine.events]
    if defer:
        assert ev == [("launched", 1), ("done", 1), ("commit", 1),
                      ("launched", 2), ("send", ["out1"]), ("done", 2), ("commit", 2),
                      ("launched", 3), ("send", ["out2"]), ("done", 3), ("commit", 3),
                      ("send", ["out3"])]
    else:
        assert ev == [("launched", 1), ("done", 1), ("commit", 1), ("send", ["out1"]),
                      ("launched", 2), ("done", 2), ("commit", 2), ("send", ["out2"]),
                      ("launched", 3), ("done", 3), ("commit", 3), ("send", ["out3"])]
    assert all(e[2] == 0 for e in engine.events if e[0] == "send")  # the commit's epoch


def test_an_eplb_rebalance_sends_the_steps_outputs_first(monkeypatch):
    # a rebalance moves expert weights for seconds: the committed step's tokens must not
    # wait behind it for the next forward
    from types import SimpleNamespace

    from elasticep.elastic import placement_sync
    loop, engine, _ = fake_loop(monkeypatch, 0, [[1], [1]], peer_tokens=0, defer_publish=True)

    class Eplb:
        def step(self):
            return True

        def rebalance(self, placement, sync, group):
            engine.events.append(("rebalance",))
            return SimpleNamespace(placement=None)

    loop.eplb = Eplb()
    monkeypatch.setattr(placement_sync, "commit_placement",
                        lambda *a: engine.events.append(("weights moved",)))
    loop.step()
    ev = [e[:2] for e in engine.events]
    assert ev.index(("send", ["out1"])) < ev.index(("rebalance",)), ev


def test_a_failed_last_send_keeps_the_reason_the_loop_ended(monkeypatch):
    import elasticep.distributed as ed
    from elasticep.frontend_link import FrontendUnreachableError
    loop, _, _ = fake_loop(monkeypatch, 0, [[1], [1]], peer_tokens=0, defer_publish=True)
    loop.step()  # a step committed, its outputs held for the next forward

    def evicted():
        raise ed.RankEvictedError("evicted")

    def unreachable(outputs, epoch=None):
        raise FrontendUnreachableError("queue full")

    monkeypatch.setattr(loop, "step", evicted)
    loop.channel.send_outputs = unreachable
    with pytest.raises(ed.RankEvictedError):  # not the send's error
        loop.run()


def test_a_prefill_step_sends_the_last_steps_outputs_before_its_forward(monkeypatch):
    # a prefill's eager forward holds the host until nearly its end: the decode step's
    # outputs (first tokens, say) go out before it is launched, not beside it
    loop, engine, _ = fake_loop(monkeypatch, 0, [[1, 1], [256, 1], [1, 1]], peer_tokens=0,
                                defer_publish=True)
    for _ in range(3):
        loop.step()
    ev = [e[:2] for e in engine.events]
    assert ev == [("launched", 1), ("done", 1), ("commit", 1),
                  ("send", ["out1"]), ("launched", 2), ("done", 2), ("commit", 2),
                  ("launched", 3), ("send", ["out2"]), ("done", 3), ("commit", 3)], ev
