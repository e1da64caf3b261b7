"""Microbench of the same-host exchange (``--moe-a2a-backend cuda_ipc``), end to end.

``G`` processes (default: all on GPU 0, as ranks share one GPU in this project's test
topology) each build an :class:`~elasticep.moe.exchange.ipc_exchange.IpcExchange`, publish and map
their buffers through a TCPStore on 127.0.0.1, then capture one CUDA graph of
``--layers`` x (dispatch, an identity "expert", combine): the product's kernels, signals
and waits, with nothing else in the graph. Per tokens-per-rank value it reports the
median time of one layer's dispatch + combine, the bytes each rank moved to its peers
per layer (real rows only: ``2 * T * k * (G-1)/G * H * elem`` on average for uniform
routing), and the device-to-device copy bandwidth measured in the same process, so the
time can be set against what those bytes cost at that bandwidth. It also checks that
every pair came back to its sender unchanged (identity experts).

    python -m bench.ipc_exchange --world 2 --tokens 1,16,128
    python -m bench.ipc_exchange --world 4 --tokens 1,16,128
    python -m bench.ipc_exchange --world 1 --max-ep-size 2 --static   # serve's EP1 step

``--static`` sends through the static dispatch map (the fused gather + plan + send
kernel that a served decode step runs) instead of a precomputed slot tensor;
``--block-h`` and ``--num-warps`` override the send kernels' copy width and warps, to
try other values without editing the module.

Prints one JSON line per world size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench._commit import commit

H, K, S = 2048, 8, 32  # Qwen3-30B-A3B's hidden size and top-k; slots per rank


def _barrier(store: dist.Store, name: str, world: int) -> None:
    store.add(name, 1)
    deadline = time.monotonic() + 120
    while int(store.add(name, 0)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name!r} incomplete after 120 s")
        time.sleep(0.001)


def _copy_gbps(nbytes: int = 256 << 20) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t0) / 1e9  # read + write


def _profiled(graph: torch.cuda.CUDAGraph, n: int = 5) -> dict:
    """Per replay: GPU busy, gap and the top kernels of ``n`` replays (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from elasticep.utils.profile_summary import summarize_profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    summary = summarize_profile(p, n, wall)
    return {k: summary[k] for k in summary if not k.startswith("top_host")}


def _rank(me: int, world: int, port: int, tokens: list[int], args, results) -> None:
    from bench.spike_stream_wait import replay_ms
    from elasticep.moe import fused_exchange_kernels
    from elasticep.moe.exchange import ipc_kernels
    from elasticep.moe.exchange.ipc_buffers import capacity_rows
    from elasticep.moe.exchange.ipc_exchange import IpcExchange
    from elasticep.moe.exchange.padded_exchange import pair_capacity
    from elasticep.moe.fused_exchange import FusedForms
    layers, replays, G = args.layers, args.replays, max(args.max_ep_size or world, world)
    if args.block_h:
        ipc_kernels.BLOCK_H = args.block_h
    if args.num_warps:
        ipc_kernels.NUM_WARPS = args.num_warps
    if args.block_n:
        fused_exchange_kernels.FUSED_BLOCK_N = args.block_n
    try:
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=(me == 0),
                              timeout=timedelta(seconds=120))
        ex = IpcExchange(me, G, capacity_rows(max(tokens), K), H, torch.bfloat16, layers,
                         "cuda")
        ex.publish(store)
        ex.warm_kernels()
        _barrier(store, "published", world)
        ex.map_peers(store, list(range(world)))
        ex.reset(torch.arange(G) < world)
        identity = torch.arange(G * S, device="cuda")  # logical expert e -> slot e
        ex.tag_cap(S)
        fused = FusedForms(ex)
        fused.warm()
        gbps = _copy_gbps()
        out = {"rank": me, "copy_gbps": round(gbps, 1), "rows": []}
        g = torch.Generator().manual_seed(me)
        for T in tokens:
            hidden = (torch.randn(T, H, generator=g) * 0.1).to(torch.bfloat16).cuda()
            slots = torch.stack([torch.randperm(world * S, generator=g)[:K]
                                 for _ in range(T)]).cuda()
            C = pair_capacity(T, K, S)

            def step(hidden=hidden, slots=slots, C=C) -> torch.Tensor:
                back = None
                for layer in range(layers):
                    if args.static:
                        handle = fused.send_dispatch_static(hidden, slots, identity, S, C, layer)
                    else:
                        handle = ex.send_dispatch(hidden, slots, S, C, layer)
                    rows, _ = ex.recv_dispatch(handle)
                    ex.send_combine(rows.contiguous(), handle)
                    back = ex.recv_combine(handle)[handle.position]
                return back

            _barrier(store, f"eager{T}", world)
            step()
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                back = step()
            torch.cuda.synchronize()
            _barrier(store, f"replay{T}", world)
            times = replay_ms(graph, replays)
            prof = _profiled(graph) if args.profile and me == 0 else None
            ok = bool(torch.equal(back, hidden.repeat_interleave(K, 0)))
            remote = int((slots // S != me).sum())  # pairs this rank sent to peers
            per_layer_us = statistics.median(times) * 1e3 / layers
            moved = 2 * remote * H * 2  # dispatch + combine, bf16, real rows only
            out["rows"].append({
                "tokens_per_rank": T, "layer_us": round(per_layer_us, 1),
                "layer_us_min_max": [round(min(times) * 1e3 / layers, 1),
                                     round(max(times) * 1e3 / layers, 1)],
                "bytes_to_peers_per_layer": moved,
                "bound_us_at_copy_bw": round(moved / (gbps * 1e9 / 2) * 1e6, 2),
                "roundtrip_equal": ok, **({"profile": prof} if prof else {})})
            _barrier(store, f"done{T}", world)
        results.put(out)
        # the master holds the store: it leaves last, or a peer's last poll fails
        store.add("left", 1)
        if me == 0:
            _barrier(store, "left", world)
    except Exception as exc:  # noqa: BLE001 - reported by the launcher
        import traceback
        results.put({"rank": me, "error": f"{exc!r}\n{traceback.format_exc()[-2000:]}"})


def main(argv: list[str] | None = None) -> int:
    """Run one world size; print its JSON line; exit 1 on an error or a wrong row."""
    ap = argparse.ArgumentParser(prog="python -m bench.ipc_exchange",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", default="1,16,128")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--max-ep-size", type=int, default=0,
                    help="slots G of the exchange (default: --world); the rest are inactive")
    ap.add_argument("--static", action="store_true",
                    help="send through the static dispatch map (the served decode path)")
    ap.add_argument("--profile", action="store_true",
                    help="rank 0 adds a torch.profiler summary of 5 replays per size")
    ap.add_argument("--block-h", type=int, default=0, help="send kernels' BLOCK_H")
    ap.add_argument("--num-warps", type=int, default=0, help="send kernels' num_warps")
    ap.add_argument("--block-n", type=int, default=0,
                    help="fused dispatch's scan block (0: sized to the step, as served)")
    args = ap.parse_args(argv)
    tokens = [int(x) for x in args.tokens.split(",")]
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, tokens, args, results)) for r in range(args.world)]
    for p in procs:
        p.start()
    outs = []
    try:
        for _ in procs:
            outs.append(results.get(timeout=300))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    outs.sort(key=lambda o: o["rank"])
    line = {"bench": "ipc_exchange", "world": args.world,
            "max_ep_size": max(args.max_ep_size, args.world), "static": args.static,
            "block_h": args.block_h or None, "num_warps": args.num_warps or None,
            "block_n": args.block_n or None,
            "layers": args.layers, "hidden": H, "top_k": K, "ranks": outs,
            "commit": commit()}
    print(json.dumps(line), flush=True)
    bad = any("error" in o or not all(r["roundtrip_equal"] for r in o["rows"]) for o in outs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
