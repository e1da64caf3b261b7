"""The same-host exchange on a GPU (elasticep.moe.exchange.ipc_exchange; GPU only).

- The send kernels against their torch reference: two exchanges of one process, mapped
  to each other, move the same rows and tags as the CPU simulation; the fused down
  projection and combine send returns what the expert kernels plus the combine send do.
- The decode forward with ``transport`` is ONE graph, and its logits equal the local
  executor's (the single-rank engine) in fp32, graph and eager alike.
- A peer that never signals blocks the replay until :meth:`IpcExchange.abort`; the
  replay then ends within the watchdog's deadline, the step's own rows are intact, and
  the context still runs kernels.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from elasticep.elastic.rank_model import attach_ep_executor, load_rank_weights
from elasticep.elastic.step_header import agreed_max_tokens
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.eplb.placement import initial_placement
from elasticep.models.config import load_model_config
from elasticep.moe.exchange import stream_memops
from elasticep.moe.exchange.ipc_buffers import capacity_rows
from elasticep.moe.exchange.ipc_exchange import SOLO, IpcExchange
from elasticep.moe.exchange.padded_exchange import pair_capacity, split_rows
from elasticep.moe.fused_exchange import FusedForms
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not stream_memops.available(),
                                 reason="needs CUDA and cuda-bindings"),
              pytest.mark.timeout(300)]

H, K, S = 256, 2, 4


def _pair(device: str, dtype: torch.dtype, cap: int = 256) -> list[IpcExchange]:
    exs = [IpcExchange(r, 2, cap, H, dtype, 4, device) for r in range(2)]
    for ex in exs:
        ex.map_local(dict(enumerate(exs)))
        ex.reset(torch.ones(2, dtype=torch.bool))
    return exs


def _run(exs: list[IpcExchange], inputs, C: int, layer: int):
    handles = [ex.send_dispatch(h, s, S, C, layer)
               for ex, (h, s) in zip(exs, inputs, strict=True)]
    got = []
    for ex, handle in zip(exs, handles, strict=True):
        rows, tags = ex.recv_dispatch(handle)
        got.append((rows.clone(), tags.clone()))
        ex.send_combine((rows * tags.unsqueeze(1).to(rows.dtype)).contiguous(), handle)
    backs = [ex.recv_combine(handle).clone() for ex, handle in zip(exs, handles, strict=True)]
    return got, backs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 16, 100])
@pytest.mark.parametrize("flag_reset", ["memop", "kernel"])
def test_send_kernels_match_the_reference(dtype, tokens, flag_reset, monkeypatch):
    monkeypatch.setenv("ELASTICEP_IPC_FLAG_RESET", flag_reset)
    g = torch.Generator().manual_seed(tokens)
    inputs = []
    for _ in range(2):
        h = torch.randn(tokens, H, generator=g).to(dtype)
        s = torch.stack([torch.randperm(2 * S, generator=g)[:K] for _ in range(tokens)])
        inputs.append((h, s))
    C = pair_capacity(tokens, K, S)
    ref_rows, ref_back = _run(_pair("cpu", dtype), inputs, C, 1)
    gpu = _pair("cuda", dtype)
    got_rows, got_back = _run(gpu, [(h.cuda(), s.cuda()) for h, s in inputs], C, 1)
    for (rr, rt), (gr, gt) in zip(ref_rows, got_rows, strict=True):
        assert torch.equal(gt.cpu(), rt)
        real = rt != 0
        assert torch.equal(gr.cpu()[real], rr[real])
    for r, b in zip(ref_back, got_back, strict=True):
        assert torch.equal(b.cpu(), r)
    for ex in gpu:
        # with the kernels clearing flags, the combine's (column 3) waits left theirs set
        # and the combine send cleared the dispatch's (column 2)
        left = ex.flags.clone()
        if flag_reset == "kernel":
            assert int(left[1 - ex.rank, 3]) == 1
            left[1 - ex.rank, 3] = 0
        assert int(left.abs().sum()) == 0 and int(ex.counter.abs().sum()) == 0


@pytest.mark.parametrize("live", [[0, 1], [0]])
@pytest.mark.parametrize("flag_reset", ["memop", "kernel"])
def test_the_fused_down_projection_sends_what_the_combine_send_sends(live, flag_reset,
                                                                    monkeypatch):
    # two layers, so the kernel flag reset clears the layer before; with one rank live,
    # a late write of garbage tags into the inactive source's block is read as padding
    from elasticep.moe.experts.expert_compute import grouped_swiglu
    from elasticep.moe.experts.small_batch_experts import gate_up_rows

    monkeypatch.setenv("ELASTICEP_IPC_FLAG_RESET", flag_reset)
    dtype, inter, T = torch.bfloat16, 128, 3
    g = torch.Generator().manual_seed(len(live))
    w13 = [(torch.randn(S, 2 * inter, H, generator=g) / H**0.5).to(dtype).cuda() for _ in live]
    w2 = [(torch.randn(S, H, inter, generator=g) / inter**0.5).to(dtype).cuda() for _ in live]
    C = pair_capacity(T, K, S)
    results = {}
    for fused in (False, True):
        exs = _pair("cuda", dtype)
        mask = torch.tensor([q in live for q in range(2)])
        for ex in exs:
            ex.reset(mask)
        got = []
        for layer in (0, 1):
            gl = torch.Generator().manual_seed(layer)
            plans = {}
            for r in live:
                h = torch.randn(T, H, generator=gl).to(dtype).cuda()
                s = torch.stack([torch.randperm(len(live) * S, generator=gl)[:K]
                                 for _ in range(T)]).cuda()
                plans[r] = exs[r].send_dispatch(h, s, S, C, layer)
            if live == [0]:
                split_rows(exs[0].recv0, H)[1][C:2 * C] = 1 << 20
            for r in live:
                ex = exs[r]
                rows, tags = ex.recv_dispatch(plans[r], clamp=False)
                bound = (ex.tag_cap(S), C)
                if fused:
                    act = gate_up_rows(w13[r], rows, tags,
                                       rows.new_empty(rows.shape[0], inter),
                                       tag_bound=(bound[0].view(-1), C))
                    FusedForms(ex).send_combine_down(act, tags, w2[r], plans[r])
                else:
                    out = grouped_swiglu(w13[r], w2[r], rows, tags, tag_bound=bound)
                    ex.send_combine(out, plans[r])
            for r in live:
                back = exs[r].recv_combine(plans[r])
                got.append(back[plans[r].position].clone())
        torch.cuda.synchronize()
        results[fused] = got
        flags = [ex.flags.clone() for ex in exs]
        results[fused, "flags"] = [f.cpu() for f in flags]
    for a, b in zip(results[False], results[True], strict=True):
        assert torch.equal(a, b)
        assert float(a.float().abs().max()) > 0
    for a, b in zip(results[False, "flags"], results[True, "flags"], strict=True):
        assert torch.equal(a, b)  # the same flags set and cleared


def _engine(tmp_path: Path, transport: bool):
    shutil.copy(DEMO_MODEL / "config.json", tmp_path / "config.json")
    cfg = load_model_config(tmp_path)
    placement = initial_placement(cfg.num_hidden_layers, cfg.num_experts, 0, 1, 2)
    model = load_rank_weights(tmp_path, placement, 0, torch.float32, "cuda",
                              load_format="dummy")
    ep = None
    if transport:
        ep, _ = attach_ep_executor(model, placement, 0, None, "static")
        ex = IpcExchange(0, 2, capacity_rows(512, cfg.num_experts_per_tok), cfg.hidden_size,
                         torch.float32, cfg.num_hidden_layers, "cuda")
        ex.warm_kernels()
        ex.reset(torch.tensor([True, False]))
        ep.transport = ex
    eng = LLMEngine(model, EngineConfig(max_total_tokens=4096, max_num_seqs=8,
                                        forward_empty_batches=True, enable_cuda_graph=True))
    return eng, ep


@pytest.mark.parametrize("form,flag_reset,lens", [
    *[(f, r, (5, 33, 17)) for f in ("solo", "plain") for r in ("memop", "kernel")],
    # one sequence: its decode steps replay the one-token graph, whose layers route
    # inside the dispatch send (routed_dispatch)
    ("solo", "kernel", (9,)), ("plain", "kernel", (9,))])
def test_transport_decode_is_one_graph_and_equals_the_local_engine(tmp_path, flag_reset, form,
                                                                   lens, monkeypatch):
    # one active rank of two: the graphs replay the form without waits ("solo"), or,
    # with the host's view of the membership forced, the form that waits on the peer
    # (whose flags the send kernels set themselves)
    monkeypatch.setenv("ELASTICEP_IPC_FLAG_RESET", flag_reset)
    from elasticep.moe import fused_exchange_kernels
    routed_calls = []
    real_routed = fused_exchange_kernels.routed_dispatch
    monkeypatch.setattr(fused_exchange_kernels, "routed_dispatch",
                        lambda *a, **kw: routed_calls.append(1) or real_routed(*a, **kw))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    local, _ = _engine(tmp_path / "a", transport=False)
    eng, ep = _engine(tmp_path / "b", transport=True)
    g = eng.runner.graphs
    assert g is not None and set(g._graphs) == {(b, v) for b in g.buckets for v in (None, SOLO)}
    assert {p.num_pieces for p in g._graphs.values()} == {1}
    assert ep.graph_variant() == SOLO
    if form == "plain":
        ep.transport.solo = False
    want_form = SOLO if form == "solo" else None
    gen = torch.Generator().manual_seed(0)
    # the one-token graphs were captured with the routing in their dispatch sends
    assert len(routed_calls) >= load_model_config(tmp_path / "b").num_hidden_layers
    prompts = [torch.randint(10, 8000, (n,), generator=gen).tolist() for n in lens]
    for e in (local, eng):
        for i, p in enumerate(prompts):
            e.add_request(GenerateRequest(f"r{i}", tuple(p),
                                          SamplingParams(max_tokens=12, ignore_eos=True)))
    steps = 0
    while eng.has_unfinished():
        a, b = local.schedule(), eng.schedule()
        want = local.runner.forward(a)
        with agreed_max_tokens(ep, max(b.num_tokens, len(lens))):
            got = eng.runner.forward(b)
            assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
            local.commit(a, local.execute(a))
            eng.commit(b, eng.execute(b))
        steps += 1
    # (with one sequence, every replay is of the one-token graph: the step's agreed
    # bound is 1)
    assert steps >= 12 and g.replays >= 10 and g.captures == 1
    assert g._last_variant == want_form
    flags = ep.transport.flags.clone()
    if flag_reset == "memop" and form == "solo":  # no wait ran, so none reset its flag
        assert bool((flags[1] == 1).all())
        flags[1] = 0
    elif flag_reset == "kernel":  # the last exchange's wait left the inactive peer's set
        assert int(flags[1, -1]) == 1
        flags[1, -1] = 0
    assert int(flags.abs().sum()) == 0


@pytest.mark.parametrize("release", ["abort", "deadline"])
@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_a_silent_peer_blocks_the_graph_until_released(release, phase):
    from elasticep.elastic.exchange_watchdog import StepWatchdog
    exs = _pair("cuda", torch.bfloat16)
    ex, peer = exs  # the peer dies before signalling, in the chosen phase of layer 2
    layer = 2
    C = pair_capacity(4, K, S)
    h = torch.randn(4, H, device="cuda").to(torch.bfloat16)
    s = torch.tensor([[0, 1], [4, 5], [2, 6], [3, 7]], device="cuda")
    if phase == "combine":  # it sent its dispatch rows, then died
        peer.send_dispatch(h, s, S, C, layer)
        torch.cuda.synchronize()
    ex.tag_cap(S)  # before the capture, as setting an executor's transport does
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        plan = ex.send_dispatch(h, s, S, C, layer)
        rows, tags = ex.recv_dispatch(plan)
        ex.send_combine(rows.contiguous(), plan)
        back = ex.recv_combine(plan)
        mine = back[plan.position].float()
    graph.replay()
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.3)
    assert not done.query(), "the replay must wait for the silent peer"
    t0 = time.monotonic()
    deadline_s = 0.2
    if release == "abort":
        threading.Thread(target=ex.abort).start()
    else:
        dog = StepWatchdog(ex, lambda: False, deadline_s=deadline_s)
        dog.begin()
    while not done.query():
        assert time.monotonic() - t0 < 3.0, "the wait was not released"
        time.sleep(0.001)
    released = time.monotonic() - t0
    assert released < deadline_s + 1.0 and ex.aborted and ex.active.tolist() == [1, 0]
    if release == "deadline":
        assert dog.end() and dog.deadline_aborts == 1
    # the pairs this rank sent to itself came back intact
    own = (s // S == 0).reshape(-1).cuda()
    assert torch.equal(mine[own], h.float().repeat_interleave(K, 0)[own])
    assert float(torch.ones(1000, device="cuda").sum()) == 1000.0  # the context still runs
    ex.reset(torch.ones(2, dtype=torch.bool))
    assert int(ex.flags.abs().sum()) == 0


@pytest.mark.parametrize("G,T,k,S", [(2, 1, 8, 64), (2, 256, 8, 64), (4, 37, 8, 32)])
def test_fused_plan_matches_the_torch_plan(G, T, k, S):
    from elasticep.moe.exchange.ipc_kernels import fused_plan, inverse_positions
    from elasticep.moe.exchange.padded_exchange import plan_padded
    g = torch.Generator().manual_seed(T)
    slots = torch.stack([torch.randperm(G * S, generator=g)[:k] for _ in range(T)]).cuda()
    C = pair_capacity(T, k, S)
    want = plan_padded(slots, S, G, C)
    position, tag, inv = fused_plan(slots, S, G, C)
    assert torch.equal(position, want.position) and torch.equal(tag, want.tag)
    assert torch.equal(inv, inverse_positions(want.position, G * C))


def test_warm_kernels_compile_every_send_form_a_step_takes():
    # A served rank's first large prefill step once compiled the dispatch send on the
    # request path: warm_kernels had compiled another form (one pair a token, and
    # Triton specializes an integer equal to 1). After warm_kernels, sends of any token
    # count, top-k and layer must find their compiled form.
    from elasticep.moe.exchange import ipc_kernels
    Hw = 384  # a width no other test of this file uses: these forms are this test's own
    exs = [IpcExchange(r, 2, 4096, Hw, torch.bfloat16, 4, "cuda") for r in range(2)]
    for ex in exs:
        ex.map_local(dict(enumerate(exs)))
        ex.reset(torch.ones(2, dtype=torch.bool))
        ex.warm_kernels()
    dev = torch.cuda.current_device()
    caches = [k.device_caches[dev][0] for k in (ipc_kernels._dispatch_send_kernel,
                                                 ipc_kernels._combine_send_kernel)]
    warmed = [len(c) for c in caches]
    assert min(warmed) >= 1
    g = torch.Generator().manual_seed(0)
    for layer, (T, k) in enumerate([(1, 8), (255, 8), (300, 6), (17, 1)]):
        inputs = [(torch.randn(T, Hw, generator=g).to(torch.bfloat16).cuda(),
                   torch.stack([torch.randperm(2 * S, generator=g)[:k]
                                for _ in range(T)]).cuda()) for _ in exs]
        _run(exs, inputs, pair_capacity(T, k, S), layer)
    torch.cuda.synchronize()
    assert [len(c) for c in caches] == warmed


@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_fused_static_dispatch_matches_the_reference(tokens):
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    l2p = torch.randperm(2 * S, generator=g)
    ids = torch.stack([torch.randperm(2 * S, generator=g)[:K] for _ in range(tokens)])
    C = pair_capacity(tokens, K, S)
    ref = _pair("cpu", torch.bfloat16, cap=512)
    ref[0].send_dispatch(hidden, l2p[ids], S, C, 1)
    gpu = _pair("cuda", torch.bfloat16, cap=512)
    pos = FusedForms(gpu[0]).send_dispatch_static(hidden.cuda(), ids.cuda(), l2p.cuda(), S, C,
                                                  1).position
    torch.cuda.synchronize()
    from elasticep.moe.exchange.padded_exchange import plan_padded, split_rows
    assert torch.equal(pos.cpu(), plan_padded(l2p[ids], S, 2, C).position)
    for q in range(2):
        want_rows, want_tags = split_rows(ref[q].recv0[:2 * C], H)
        rows, tags = split_rows(gpu[q].recv0[:2 * C], H)
        assert torch.equal(tags.cpu(), want_tags)
        real = want_tags != 0
        assert torch.equal(rows.cpu()[real], want_rows[real])
    assert int(gpu[1].flags[0, 2]) == 1 and int(gpu[0].counter.sum()) == 0


@pytest.mark.parametrize("E,k,norm,dtype", [(128, 8, True, torch.bfloat16),
                                            (60, 4, False, torch.bfloat16),
                                            (64, 6, True, torch.float32)])
def test_routed_dispatch_equals_the_router_kernel_then_the_fused_dispatch(E, k, norm, dtype):
    # the one-token form of a decode layer (Qwen3-30B-A3B: 128 experts, top-8): the
    # routing inside the send picks the router kernel's experts and weights bit for bit
    # and sends the rows the fused dispatch sends, with the same flags
    from elasticep.models.fused_routing import fused_softmax_topk
    from elasticep.moe.softmax_topk import SoftmaxTopk
    g = torch.Generator().manual_seed(E + k)
    Hq, Sq = 2048, -(-E // 2)
    hidden = torch.randn(1, Hq, generator=g).to(dtype).cuda()
    rule = SoftmaxTopk(k, norm, 2.5 if not norm else 1.0)
    l2p = torch.randperm(2 * Sq, generator=g)[:E].cuda()
    C = pair_capacity(1, k, Sq)
    for trial in range(20):  # new logits each time, the same world (flags reset by the sends)
        logits = (torch.randn(1, E, generator=g) * 2).to(dtype).cuda()
        got = [IpcExchange(r, 2, 64, Hq, dtype, 4, "cuda") for r in range(2)]
        want = [IpcExchange(r, 2, 64, Hq, dtype, 4, "cuda") for r in range(2)]
        for w in (got, want):
            for ex in w:
                ex.map_local(dict(enumerate(w)))
                ex.reset(torch.ones(2, dtype=torch.bool))
        assert FusedForms(got[0]).routes_in_dispatch(hidden, logits, k)
        handle, ids, weights = FusedForms(got[0]).send_dispatch_routed(hidden, logits, rule,
                                                                       l2p, Sq, C, 1)
        want_ids, want_w = fused_softmax_topk(logits, k, norm, rule.routed_scaling_factor, dtype)
        want_handle = FusedForms(want[0]).send_dispatch_static(hidden, want_ids, l2p, Sq, C, 1)
        torch.cuda.synchronize()
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w), trial
        assert torch.equal(handle.position, want_handle.position)
        for q in range(2):
            assert torch.equal(got[q].recv0, want[q].recv0)
            assert torch.equal(got[q].flags, want[q].flags)
        assert int(got[1].flags[0, 2]) == 1 and int(got[0].counter.sum()) == 0
