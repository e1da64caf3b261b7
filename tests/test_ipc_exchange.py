"""The same-host exchange (elasticep.moe.exchange.ipc_exchange) simulated in one process on CPU:
its torch reference path must move exactly the rows the padded all_to_all moves, mask
inactive sources, and let an aborted step run to its end. The kernels themselves and
the stream waits are compared with this reference in tests/test_ipc_exchange_gpu.py."""

from __future__ import annotations

import time

import pytest
import torch

from elasticep.config import A2ABackend, DeploymentConfig
from elasticep.elastic.exchange_setup import resolve_a2a_backend
from elasticep.elastic.exchange_watchdog import StepWatchdog
from elasticep.engine.limits import max_step_tokens
from elasticep.moe.exchange.ipc_buffers import buffer_bytes, capacity_rows
from elasticep.moe.exchange.ipc_exchange import SOLO, IpcExchange, IpcHandle
from elasticep.moe.exchange.padded_exchange import pack, pair_capacity, plan_padded, split_rows

H, K, S, LAYERS = 24, 2, 4, 3


def _world(G: int, cap: int = 64, num_layers: int = LAYERS,
           moe_layers: list[int] | None = None) -> list[IpcExchange]:
    exs = [IpcExchange(r, G, cap, H, torch.float32, num_layers, "cpu", moe_layers=moe_layers)
           for r in range(G)]
    for ex in exs:
        ex.map_local(dict(enumerate(exs)))
    return exs


def _inputs(G: int, T: int, seed: int, live: list[int]):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    # distinct slots per token, only on live ranks
    slots_live = torch.tensor([r * S + j for r in live for j in range(S)])
    picks = torch.stack([torch.randperm(len(slots_live), generator=g)[:K] for _ in range(T)])
    return hidden, slots_live[picks]


@pytest.mark.parametrize("flag_reset", ["kernel", "memop"])
@pytest.mark.parametrize("G,live", [(2, [0, 1]), (3, [0, 1, 2]), (3, [0, 2]), (2, [0])])
def test_dispatch_and_combine_match_the_padded_layout(G, live, flag_reset, monkeypatch):
    monkeypatch.setenv("ELASTICEP_IPC_FLAG_RESET", flag_reset)
    exs = _world(G)
    mask = torch.zeros(G, dtype=torch.bool)
    mask[live] = True
    for ex in exs:
        ex.reset(mask)
    T = {r: 3 + 2 * r for r in live}
    C = pair_capacity(max(T.values()), K, S)
    inputs = {r: _inputs(G, T[r], 10 + r, live) for r in live}
    layer = 1
    plans = {r: exs[r].send_dispatch(*inputs[r], S, C, layer) for r in live}
    received = {r: exs[r].recv_dispatch(plans[r]) for r in live}
    for r in live:
        rows, tags = received[r]
        for s in range(G):
            blk = slice(s * C, (s + 1) * C)
            if s not in live:
                assert torch.all(tags[blk] == 0), "an inactive source's rows must read as padding"
                continue
            # what rank s's padded send buffer holds for rank r
            send = pack(inputs[s][0], K, plan_padded(inputs[s][1], S, G, C))
            want_rows, want_tags = split_rows(send, H)
            assert torch.equal(tags[blk], want_tags[r * C:(r + 1) * C])
            real = want_tags[r * C:(r + 1) * C] != 0
            assert torch.equal(rows[blk][real], want_rows[r * C:(r + 1) * C][real])
    # experts: row * tag, so each pair comes back as hidden * (local slot + 1)
    for r in live:
        rows, tags = received[r]
        exs[r].send_combine((rows * tags.unsqueeze(1).float()).contiguous(), plans[r])
    for r in live:
        back = exs[r].recv_combine(plans[r])
        hidden, slots = inputs[r]
        got = back[plans[r].position]
        want = hidden.repeat_interleave(K, 0) * (slots.reshape(-1) % S + 1).unsqueeze(1).float()
        assert torch.equal(got, want)
    for ex in (exs[r] for r in live):
        if flag_reset == "memop":
            assert torch.all(ex.flags == 0), "every wait resets its flag"
            continue
        # the next exchange's send clears these: only the combine's flags are set, from
        # every peer (an inactive one's by this rank's own send, so its wait passed)
        want = torch.zeros_like(ex.flags)
        want[[q for q in range(G) if q != ex.rank], 2 * layer + 1] = 1
        assert torch.equal(ex.flags, want)


def test_the_one_call_forms_take_the_handle_and_sum_with_the_weights():
    """``dispatch`` then ``combine`` on one live rank of two: the handle carries the
    layout back, and each token's k outputs come back summed with its weights."""
    ex = _world(2)[0]
    ex.reset(torch.tensor([True, False]))
    hidden, slots = _inputs(2, 5, 7, [0])
    C = pair_capacity(5, K, S)
    rows, tags, handle = ex.dispatch(hidden, slots, S, C, 1)
    assert (handle.capacity, handle.layer, handle.slots_per_rank) == (C, 1, S)
    weights = torch.rand(5, K, generator=torch.Generator().manual_seed(1))
    got = ex.combine((rows * tags.unsqueeze(1).float()).contiguous(), handle, weights)
    pairs = hidden.unsqueeze(1) * (slots % S + 1).unsqueeze(2).float()  # [T, k, H]
    want = (pairs * weights.unsqueeze(2)).sum(1)
    assert got.dtype == hidden.dtype and torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def _steps(exs: list[IpcExchange], steps: int, T: int = 3,
           layers: list[int] | None = None) -> None:
    """``steps`` whole steps (each of ``layers``' dispatch and combine; default all
    LAYERS) on every rank, in lockstep; each pair must come back as hidden * (its local
    slot + 1)."""
    G = len(exs)
    C = pair_capacity(T, K, S)
    for step in range(steps):
        inputs = [_inputs(G, T, 100 * step + r, list(range(G))) for r in range(G)]
        for layer in (range(LAYERS) if layers is None else layers):
            plans = [ex.send_dispatch(*inputs[r], S, C, layer) for r, ex in enumerate(exs)]
            received = [ex.recv_dispatch(plan) for ex, plan in zip(exs, plans, strict=True)]
            for ex, (rows, tags), plan in zip(exs, received, plans, strict=True):
                ex.send_combine((rows * tags.unsqueeze(1).float()).contiguous(), plan)
            for r, ex in enumerate(exs):
                hidden, slots = inputs[r]
                got = ex.recv_combine(plans[r])[plans[r].position]
                want = (hidden.repeat_interleave(K, 0)
                        * (slots.reshape(-1) % S + 1).unsqueeze(1).float())
                assert torch.equal(got, want)


def test_send_kernels_clear_the_flags_their_waits_leave_set(monkeypatch):
    # ELASTICEP_IPC_FLAG_RESET=kernel: a wait leaves its flag at 1 and the next
    # exchange's send clears it; over two steps every signal finds its flag cleared
    # (the simulation raises on a lost reset)
    monkeypatch.setenv("ELASTICEP_IPC_FLAG_RESET", "kernel")
    exs = _world(3)
    for ex in exs:
        ex.reset(torch.ones(3, dtype=torch.bool))
        assert ex.reset_in_kernel
    _steps(exs, steps=2)
    last = 2 * LAYERS - 1
    for ex in exs:  # only the last exchange's flags are still set, from every peer
        peers = [q for q in range(3) if q != ex.rank]
        assert torch.all(ex.flags[peers, last] == 1)
        assert torch.all(ex.flags[:, :last] == 0)


def test_dense_layers_leave_no_gap_in_the_flag_columns(monkeypatch):
    # DeepSeek-style: decoder layers 0 and 2 are dense, 1, 3 and 4 exchange. The first
    # exchange of a step must clear the last one of the step before (a numbering by
    # decoder layer would clear the unused column of layer 0 instead, and the second
    # step's last combine would find its flag still set: a lost reset)
    monkeypatch.setenv("ELASTICEP_IPC_FLAG_RESET", "kernel")
    moe = [1, 3, 4]
    exs = _world(2, num_layers=5, moe_layers=moe)
    for ex in exs:
        ex.reset(torch.ones(2, dtype=torch.bool))
        assert ex.n_slots == 2 * len(moe)
    _steps(exs, steps=3, layers=moe)
    for ex in exs:
        assert int(ex.flags[1 - ex.rank, -1]) == 1
        assert torch.all(ex.flags[:, :-1] == 0)
    with pytest.raises(ValueError, match="layer 2 does not exchange"):
        exs[0].send_dispatch(*_inputs(2, 3, 0, [0, 1]), S, pair_capacity(3, K, S), 2)


@pytest.mark.parametrize("moe_layers", [[], [2, 1], [0, 5]])
def test_bad_moe_layers_are_refused(moe_layers):
    with pytest.raises(ValueError, match="want increasing decoder layers"):
        IpcExchange(0, 2, 16, H, torch.float32, 5, "cpu", moe_layers=moe_layers)


def test_a_lost_flag_reset_is_an_error_in_simulation(monkeypatch):
    monkeypatch.setenv("ELASTICEP_IPC_FLAG_RESET", "kernel")
    exs = _world(2)
    for ex in exs:
        ex.reset(torch.ones(2, dtype=torch.bool))
    _steps(exs, steps=1)
    # slot 2L-1 is still set on rank 1 (rank 0's last combine signal): a second combine
    # send of the last layer, with no exchange between to clear it, would pass early
    with pytest.raises(RuntimeError, match="lost reset"):
        C = pair_capacity(3, K, S)
        exs[0].send_combine(torch.zeros(2 * C, H),
                            IpcHandle(torch.zeros(0, dtype=torch.long), C, torch.float32,
                                      LAYERS - 1, S))


def test_an_unknown_flag_reset_mode_is_refused(monkeypatch):
    monkeypatch.setenv("ELASTICEP_IPC_FLAG_RESET", "both")
    with pytest.raises(ValueError, match="expected 'memop' or 'kernel'"):
        _world(1)


def test_a_wait_without_its_signal_is_an_error_in_simulation():
    exs = _world(2)
    for ex in exs:
        ex.reset(torch.ones(2, dtype=torch.bool))
    hidden, slots = _inputs(2, 4, 0, [0, 1])
    handle = exs[0].send_dispatch(hidden, slots, S, pair_capacity(4, K, S), 0)
    with pytest.raises(RuntimeError, match="no signal from 1"):
        exs[0].recv_dispatch(handle)


def test_the_solo_form_is_picked_from_the_membership_and_records_no_wait():
    from elasticep.engine.piecewise_graph import PiecewiseCapture
    from elasticep.eplb.metadata import ExpertLocationMetadata
    from elasticep.eplb.placement import initial_placement
    from elasticep.moe.cuda_executor import CudaEPMoEExecutor
    from elasticep.utils.graph_boundary import capture_variant

    exs = _world(2)
    ex = exs[0]
    assert ex.solo  # a new exchange knows only itself
    ex.reset(torch.ones(2, dtype=torch.bool))
    assert not ex.solo
    # a wait for a peer that has not signalled: an error, except in the solo form
    C = pair_capacity(4, K, S)
    handle = ex.send_dispatch(*_inputs(2, 4, 0, [0, 1]), S, C, 0)
    with pytest.raises(RuntimeError, match="no signal from 1"):
        ex.recv_dispatch(handle)
    with PiecewiseCapture(bound=4, variant=SOLO):
        assert capture_variant() == SOLO
        ex.recv_dispatch(handle)
    assert capture_variant() is None
    ex.reset(torch.tensor([True, False]))
    assert ex.solo
    # the executor offers the form with peer slots, and names it while no peer is active
    L, E, Hs, inter = 3, 4, H, 6
    p = initial_placement(L, E, 0, 1, 2)
    w13 = [torch.randn(p.slots_per_rank, 2 * inter, Hs) for _ in range(L)]
    w2 = [torch.randn(p.slots_per_rank, Hs, inter) for _ in range(L)]
    cu = CudaEPMoEExecutor(ExpertLocationMetadata.from_placement(p, 0), w13, w2, None)
    assert cu.graph_variants == (None,) and cu.graph_variant() is None
    cu.transport = ex
    assert cu.graph_variants == (None, SOLO) and cu.graph_variant() == SOLO
    ex.reset(torch.ones(2, dtype=torch.bool))  # a peer joins: the waiting form
    assert cu.graph_variant() is None
    ex.abort()  # an aborted step keeps the form it ran in; reset decides the next
    assert not ex.solo and cu.graph_variant() is None
    ex.reset(torch.tensor([True, False]))  # the peer left
    assert cu.graph_variant() == SOLO
    one = IpcExchange(0, 1, 64, H, torch.float32, LAYERS, "cpu")  # no peer slot: one form
    cu.transport = one
    assert one.solo and cu.graph_variants == (None,) and cu.graph_variant() is None


def test_the_executor_over_the_transport_equals_its_padded_path():
    """CudaEPMoEExecutor on CPU tensors with a CPU exchange of one live rank of two: the
    transport's path (the fused forms' owner falls back to the plain sends on CPU, the
    expert compute, the combine) returns what the padded path returns, layer by layer."""
    from elasticep.eplb.metadata import ExpertLocationMetadata
    from elasticep.eplb.placement import initial_placement
    from elasticep.moe.cuda_executor import CudaEPMoEExecutor
    L, E, inter, k, T = 3, 4, 6, 2, 5
    p = initial_placement(L, E, 0, 1, 2)
    g = torch.Generator().manual_seed(0)
    w13 = [torch.randn(p.slots_per_rank, 2 * inter, H, generator=g) for _ in range(L)]
    w2 = [torch.randn(p.slots_per_rank, H, inter, generator=g) for _ in range(L)]
    meta = ExpertLocationMetadata.from_placement(p, 0)
    padded = CudaEPMoEExecutor(meta, w13, w2, None, max_tokens=8)
    via = CudaEPMoEExecutor(meta, w13, w2, None, max_tokens=8)
    ex = IpcExchange(0, 2, capacity_rows(8, k), H, torch.float32, L, "cpu")
    ex.reset(torch.tensor([True, False]))
    via.transport = ex
    hidden = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    for layer in range(L):
        with padded.local_exchange():  # the padded layout, copied locally
            want = padded(layer, hidden, ids, weights)
        got = via(layer, hidden, ids, weights)
        assert torch.equal(got, want) and float(want.abs().max()) > 1
    assert int(ex.flags[1].sum()) > 0  # the sends released the inactive peer's waits


def test_abort_releases_every_wait_and_reset_restores_the_membership():
    exs = _world(3)
    full = torch.ones(3, dtype=torch.bool)
    for ex in exs:
        ex.reset(full)
    ex = exs[0]
    ex.abort()
    assert ex.aborted and ex.aborts == 1
    assert ex.active.tolist() == [1, 0, 0]
    C = pair_capacity(2, K, S)
    hidden, slots = _inputs(3, 2, 1, [0])  # the step goes on locally
    ex.recv_dispatch(ex.send_dispatch(hidden, slots, S, C, 2))  # released: no peer signalled
    ex.abort()  # idempotent
    assert ex.aborts == 1
    ex.reset(full)
    assert not ex.aborted and ex.active.tolist() == [1, 1, 1]
    assert torch.all(ex.flags == 0) and torch.all(ex.counter == 0)


def test_tags_are_clamped_to_the_slot_range():
    exs = _world(2)
    for ex in exs:
        ex.reset(torch.ones(2, dtype=torch.bool))
    C = pair_capacity(2, K, S)
    hidden, slots = _inputs(2, 2, 3, [0, 1])
    handles = [ex.send_dispatch(hidden, slots, S, C, 0) for ex in exs]
    # a stopped peer's late write of garbage into its own block
    split_rows(exs[0].recv0, H)[1][C:2 * C] = 1 << 20
    _, tags = exs[0].recv_dispatch(handles[0])
    assert int(tags.max()) <= S


def test_capacity_and_memory_arithmetic():
    assert capacity_rows(8192, 8) == 65536
    assert capacity_rows(0, 8) == 8
    # Qwen3-30B-A3B shape at --max-ep-size 2: about 1 GiB for 8192-token steps
    n = buffer_bytes(2, capacity_rows(8192, 8), 2048, torch.bfloat16, 48)
    assert 1.0e9 < n < 1.1e9
    with pytest.raises(ValueError, match="buffers hold"):
        _world(2, cap=8)[0].send_dispatch(*_inputs(2, 8, 0, [0, 1]), S, 16, 0)


def test_step_bound_and_backend_resolution():
    cuda = DeploymentConfig(model="m", device="cuda")
    assert max_step_tokens(cuda) == 8192
    assert max_step_tokens(DeploymentConfig(model="m", device="cuda", chunked_prefill_size=-1)) is None
    assert max_step_tokens(DeploymentConfig(model="m", device="cuda", max_running_requests=20000,
                                            chunked_prefill_size=512)) == 20000
    assert resolve_a2a_backend(cuda, bindings_available=True) == A2ABackend.CUDA_IPC
    assert resolve_a2a_backend(cuda, bindings_available=False) == A2ABackend.ALL_TO_ALL
    cpu = DeploymentConfig(model="m")
    assert resolve_a2a_backend(cpu, bindings_available=True) == A2ABackend.ALL_TO_ALL
    two_nodes = DeploymentConfig(model="m", device="cuda", nnodes=2, ep_size=2, max_ep_size=2)
    assert resolve_a2a_backend(two_nodes, bindings_available=True) == A2ABackend.ALL_TO_ALL
    with pytest.raises(ValueError, match="--moe-a2a-backend cuda_ipc needs"):
        DeploymentConfig(model="m", moe_a2a_backend="cuda_ipc")
    with pytest.raises(ValueError, match="--moe-a2a-backend"):
        DeploymentConfig(model="m", device="cuda", moe_a2a_backend="nvshmem")


@pytest.mark.parametrize("poll_s", [None, 0.001])
def test_watchdog_aborts_on_a_change_and_at_its_deadline(poll_s):
    ex = _world(2)[0]
    ex.reset(torch.ones(2, dtype=torch.bool))
    changed = {"v": False}
    dog = StepWatchdog(ex, lambda: changed["v"], deadline_s=0.2, poll_s=poll_s)
    dog.begin()
    assert not dog.end()
    dog.begin()
    time.sleep(0.02)  # the watchdog sleeps in the step by now
    changed["v"] = True
    if poll_s is None:
        dog.notify()  # what the group's change listener does
    t0 = time.monotonic()
    while not ex.aborted and time.monotonic() < t0 + 1.0:
        time.sleep(0.002)
    # well before the 0.2 s deadline: the change released it
    assert ex.aborted and time.monotonic() - t0 < 0.1
    assert dog.end() and dog.deadline_aborts == 0
    changed["v"] = False
    ex.reset(torch.ones(2, dtype=torch.bool))
    dog.begin()
    time.sleep(0.5)
    assert dog.end() and dog.deadline_aborts == 1


def test_the_watchdog_thread_does_not_wake_at_every_step():
    # a wake per step takes the GIL from the step loop right after the step's device
    # wait: steps begin and end without waking it, and a change during one still
    # releases that step at once
    import threading
    ex = _world(2)[0]
    ex.reset(torch.ones(2, dtype=torch.bool))
    callers: list[str] = []
    changed = {"v": False}

    def look() -> bool:
        callers.append(threading.current_thread().name)
        return changed["v"]

    dog = StepWatchdog(ex, look, deadline_s=5.0)
    for _ in range(200):
        dog.begin()
        time.sleep(0.0005)
        assert not dog.end()
    assert callers.count("ipc-exchange-watchdog") == 0
    assert callers.count(threading.current_thread().name) == 200  # begin() looked itself
    dog.begin()
    changed["v"] = True
    dog.notify()  # the group's change listener
    t0 = time.monotonic()
    while not ex.aborted and time.monotonic() < t0 + 1.0:
        time.sleep(0.002)
    assert ex.aborted and time.monotonic() - t0 < 0.1
    assert dog.end() and dog.deadline_aborts == 0


@pytest.mark.parametrize("deadline_s,poll_s", [(0.0, None), (-1.0, None), (1.0, 0.0)])
def test_a_watchdog_that_would_spin_is_refused(deadline_s, poll_s):
    with pytest.raises(ValueError, match="must be positive"):
        StepWatchdog(_world(2)[0], lambda: False, deadline_s=deadline_s, poll_s=poll_s)


def test_an_abort_decided_as_the_step_ends_belongs_to_that_step(monkeypatch):
    # the watchdog decides to abort at the deadline while the step is ending: end() must
    # wait for that abort and report it (the step is redone), never let it land on the
    # next step, which would then start with its peers masked out
    import threading
    ex = _world(2)[0]
    ex.reset(torch.ones(2, dtype=torch.bool))
    real_abort, deciding = ex.abort, threading.Event()

    def slow_abort():
        deciding.set()
        time.sleep(0.1)  # widens the window between the decision and the abort
        real_abort()

    monkeypatch.setattr(ex, "abort", slow_abort)
    dog = StepWatchdog(ex, lambda: False, deadline_s=0.05)
    dog.begin()
    assert deciding.wait(2.0)
    assert dog.end(), "end() returned before the abort decided for its step landed"
    ex.reset(torch.ones(2, dtype=torch.bool))  # the redo's reset
    dog.deadline_s = 10.0
    dog.begin()
    time.sleep(0.15)
    assert not ex.aborted and ex.active.tolist() == [1, 1]
    assert not dog.end()


def _fused_plan_cases() -> dict:
    """fused_plan against plan_padded + inverse_positions (run under TRITON_INTERPRET=1)."""
    from elasticep.moe.exchange.ipc_kernels import fused_plan, inverse_positions
    results = {}
    for G, T, k, S in [(2, 1, 8, 64), (2, 64, 8, 64), (4, 5, 2, 4), (1, 16, 2, 4)]:
        g = torch.Generator().manual_seed(G * 100 + T)
        slots = torch.stack([torch.randperm(G * S, generator=g)[:k] for _ in range(T)])
        C = pair_capacity(T, k, S)
        want = plan_padded(slots, S, G, C)
        position, tag, inv = fused_plan(slots, S, G, C)
        results[f"G{G}_T{T}"] = bool(torch.equal(position, want.position)
                                     and torch.equal(tag, want.tag)
                                     and torch.equal(inv, inverse_positions(want.position, G * C)))
    return results


def _kernel_cases() -> dict:
    """The Triton send kernels (the fused static dispatch, the dispatch and the combine
    sends) against the torch reference, on in-process pairs (under TRITON_INTERPRET=1,
    which also runs their pointer-table loads and the release atomics)."""
    from elasticep.moe import fused_exchange_kernels as fkern
    from elasticep.moe.exchange import ipc_kernels as kern
    results = {}
    # (2, 520): 1040 pairs, so the fused kernel's reduction over earlier pairs spans two
    # of its widest (1024) scan blocks and 65 programs each own a block of pairs; the
    # smaller steps scan in narrower blocks (16 or 128 lanes). A narrower
    # BLOCK_H splits each row's H=24 columns over programs (3 even parts at 8; at 16,
    # a part of 16 and one of 8), as a one-token step's send does at H=2048.
    cases = [(2, 7, 256), (3, 1, 256), (3, 20, 256), (2, 520, 256), (2, 7, 8), (3, 20, 16)]
    for G, T, block_h in cases:
        kern.BLOCK_H = block_h
        assert kern.split_for(1, H) == -(-H // block_h)
        g = torch.Generator().manual_seed(G * 10 + T)
        hidden = torch.randn(T, H, generator=g)
        l2p = torch.randperm(G * S, generator=g)
        ids = torch.stack([torch.randperm(G * S, generator=g)[:K] for _ in range(T)])
        C = pair_capacity(T, K, S)
        ref, fused, plain = _world(G, C), _world(G, C), _world(G, C)
        for w in (ref, fused, plain):
            for ex in w:
                ex.reset(torch.ones(G, dtype=torch.bool))
        handle = ref[0].send_dispatch(hidden, l2p[ids], S, C, 1)
        fused[0].flags[:, 1] = 1  # the waits of exchange 1 left these set: reset_prev clears
        pos = fkern.fused_dispatch(hidden, ids, l2p, S, 0, C, fused[0].W, fused[0].table,
                                   fused[0].active, fused[0].counter, fused[0].flags, 2,
                                   reset_prev=True)
        cleared = (torch.all(fused[0].flags[1:, 1] == 0)  # the peers' flags, not its own
                   and int(fused[0].flags[0, 1]) == 1)
        plan = plan_padded(l2p[ids], S, G, C)
        inv = kern.inverse_positions(plan.position, G * C)
        kern.dispatch_send(hidden, inv, plan.tag, K, 0, C, plain[0].W, plain[0].table,
                           plain[0].active, plain[0].counter, plain[0].flags, 2)
        ok = torch.equal(pos, plan.position) and bool(cleared)
        for q in range(G):
            want_rows, want_tags = split_rows(ref[q].recv0[:G * C], H)
            real = want_tags != 0
            for w in (fused, plain):
                rows, tags = split_rows(w[q].recv0[:G * C], H)
                ok &= torch.equal(tags, want_tags) and torch.equal(rows[real], want_rows[real])
                ok &= q == 0 or int(w[q].flags[0, 2]) == 1  # signalled
        ok &= int(fused[0].counter.sum()) == 0 and int(plain[0].counter.sum()) == 0
        # combine: rank 0 returns rows (times 2) to every source, kernel vs reference
        rows0, tags0 = split_rows(ref[0].recv0[:G * C], H)
        out = (rows0 * 2).contiguous()
        plain[0].flags[:, 2] = 1
        kern.combine_send(out, ref[0].recv0, 0, C, plain[0].table, plain[0].active,
                          plain[0].counter, plain[0].flags, 3, reset_prev=True)
        ok &= bool(torch.all(plain[0].flags[1:, 2] == 0)) and int(plain[0].flags[0, 2]) == 1
        ref[0].send_combine(out, handle)
        for q in range(G):
            ok &= torch.equal(plain[q].recv1[:G * C], ref[q].recv1[:G * C])
        results[f"G{G}_T{T}_h{block_h}"] = bool(ok)
    return results


def _routed_cases() -> dict:
    """The one-token routed dispatch (routing inside the fused send kernel) against the
    router's kernel followed by the fused dispatch, on in-process worlds: the same ids
    and weights bit for bit, the same rows, tags, positions and flags; and the ids are
    torch's top-k (under TRITON_INTERPRET=1)."""
    from elasticep.models.fused_routing import fused_softmax_topk
    from elasticep.moe import fused_exchange_kernels as fkern
    from elasticep.moe.exchange import ipc_kernels as kern
    from elasticep.moe.fused_exchange import FusedForms
    from elasticep.moe.softmax_topk import SoftmaxTopk
    results = {}
    # (G, experts, k, rule): E not a power of two; every expert chosen (k = E); k at the
    # 16 lanes of one program
    cases = [(2, 8, 2, SoftmaxTopk(2)), (3, 12, 8, SoftmaxTopk(8, True, 2.5)),
             (2, 8, 8, SoftmaxTopk(8, True)), (4, 16, 16, SoftmaxTopk(16, False, 0.5))]
    for G, E, k, rule in cases:
        kern.BLOCK_H = 256
        g = torch.Generator().manual_seed(G * 10 + k)
        hidden = torch.randn(1, H, generator=g)
        logits = torch.randn(1, E, generator=g) * 3
        l2p = torch.randperm(G * S, generator=g)[:E]  # E <= G*S: one slot each
        C = pair_capacity(1, k, S)
        routed, plain, ref = _world(G, C), _world(G, C), _world(G, C)
        for w in (routed, plain, ref):
            for ex in w:
                ex.reset(torch.ones(G, dtype=torch.bool))
            w[0].flags[:, 1] = 1  # the previous exchange's waits left these set
        pos, ids, weights = fkern.routed_dispatch(
            hidden, logits, rule, l2p, S, 0, C, routed[0].W, routed[0].table, routed[0].active,
            routed[0].counter, routed[0].flags, 2, reset_prev=True)
        want_ids, want_w = fused_softmax_topk(logits, k, rule.norm_topk_prob,
                                              rule.routed_scaling_factor, torch.float32)
        want_pos = fkern.fused_dispatch(hidden, want_ids, l2p, S, 0, C, plain[0].W,
                                        plain[0].table, plain[0].active, plain[0].counter,
                                        plain[0].flags, 2, reset_prev=True)
        # the CPU exchange's path: the torch rule, then the reference send
        ref_handle, ref_ids, ref_w = FusedForms(ref[0]).send_dispatch_routed(
            hidden, logits, rule, l2p, S, C, 1)
        ref_pos = ref_handle.position
        ok = (torch.equal(ids, want_ids) and torch.equal(weights, want_w)
              and torch.equal(pos, want_pos) and torch.equal(ids, ref_ids)
              and torch.equal(pos, ref_pos) and torch.allclose(weights, ref_w, rtol=1e-6, atol=0))
        for q in range(G):
            ok &= torch.equal(routed[q].recv0, plain[q].recv0)
            ok &= torch.equal(routed[q].flags, plain[q].flags)
            rows, tags = split_rows(routed[q].recv0[:G * C], H)
            want_rows, want_tags = split_rows(ref[q].recv0[:G * C], H)
            ok &= torch.equal(tags, want_tags) and torch.equal(rows[tags != 0],
                                                               want_rows[tags != 0])
        ok &= int(routed[0].counter.sum()) == 0
        results[f"routed_G{G}_E{E}_k{k}"] = bool(ok)
    return results


def _down_send_cases() -> dict:
    """The fused down projection and combine send (``send_combine_down``'s kernel) against
    the expert compute plus the torch combine send, at rank 0 of in-process worlds: every
    source active, or one inactive; garbage tags (beyond S, negative) in a source's
    block are read as the clamp reads them."""
    from elasticep.moe import fused_exchange_kernels as fkern
    from elasticep.moe.experts.expert_compute import grouped_swiglu
    from elasticep.moe.experts.small_batch_experts import gate_up_rows
    results = {}
    inter, T = 16, 3
    for G, live, reset_prev in [(2, [0, 1], True), (3, [0, 2], False), (2, [0], True)]:
        g = torch.Generator().manual_seed(G * 10 + len(live))
        w13 = torch.randn(S, 2 * inter, H, generator=g) / H**0.5
        w2 = torch.randn(S, H, inter, generator=g) / inter**0.5
        C = pair_capacity(T, K, S)
        mask = torch.tensor([q in live for q in range(G)])
        worlds = _world(G, C), _world(G, C)
        handles = []
        for w in worlds:
            for ex in w:
                ex.reset(mask)
            for r in live:
                hidden, slots = _inputs(G, T, r, live)
                handles.append(w[r].send_dispatch(hidden, slots, S, C, 0))
            split_rows(w[0].recv0, H)[1][live[-1] * C] = 9 * S  # a garbage tag, kept
            split_rows(w[0].recv0, H)[1][live[-1] * C + 1] = -5
        ref, fused = worlds
        handle = handles[0]  # rank 0's, the same layout in either world
        rows, tags = ref[0].recv_dispatch(handle, clamp=False)
        cap = ref[0].tag_cap(S)
        out = grouped_swiglu(w13, w2, rows, tags, use_grouped=False, tag_bound=(cap, C))
        ref[0].send_combine(out, handle)
        rows, tags = fused[0].recv_dispatch(handle, clamp=False)
        act = gate_up_rows(w13, rows, tags, rows.new_empty(G * C, inter),
                           tag_bound=(cap.view(-1), C))
        f = fused[0]
        f.flags[:, 0] = 1  # the dispatch's waits left these set: reset_prev clears them
        fkern.down_combine_send(act, tags, cap.view(-1), w2, 0, C, f.table, f.active,
                                f.counter, f.flags, 1, reset_prev=reset_prev)
        ok = int(f.counter.sum()) == 0
        for q in range(G):
            ok &= torch.allclose(fused[q].recv1[:G * C], ref[q].recv1[:G * C], atol=1e-5)
            if q:  # a live source is signalled; an inactive one's wait passes by itself
                ok &= int((fused[q] if q in live else f).flags[0 if q in live else q, 1]) == 1
                ok &= int(f.flags[q, 0]) == (0 if reset_prev else 1)
        ok &= bool(fused[0].recv1[:G * C].abs().sum() > 0)
        results[f"down_send_G{G}_live{len(live)}"] = bool(ok)
    return results


def test_kernels_equal_the_torch_reference_under_the_interpreter():
    from tests._interpreted import run_interpreted
    got = run_interpreted(__file__, timeout_s=300)
    assert len(got) == 17 and all(got.values()), got


def test_cuda_ipc_without_cuda_bindings_is_a_usage_error(monkeypatch):
    import argparse

    from elasticep.entrypoints.deployment_args import add_deployment_arguments, deployment_config
    from elasticep.entrypoints.validate import UsageError
    from elasticep.moe.exchange import stream_memops

    def missing():
        raise ImportError("CUDA stream memory operations need NVIDIA's cuda-bindings "
                          "package: pip install cuda-bindings")

    monkeypatch.setattr(stream_memops, "driver", missing)
    p = argparse.ArgumentParser()
    add_deployment_arguments(p)
    args = p.parse_args(["--device", "cuda", "--moe-a2a-backend", "cuda_ipc"])
    with pytest.raises(UsageError, match="pip install cuda-bindings"):
        deployment_config(args, warnings=[])


if __name__ == "__main__":
    import json
    print(json.dumps(_fused_plan_cases() | _kernel_cases() | _down_send_cases()
                     | _routed_cases()))
