"""Spike (issue 26): an expert exchange inside one CUDA graph, for ranks that share a GPU.

Each rank maps every peer's receive buffer and flag array (legacy CUDA IPC handles,
through torch.multiprocessing). One exchange is:

1. a Triton *send* kernel: grid (world, chunks); each program copies one chunk of this
   rank's rows for destination q into q's receive buffer, at this rank's own region;
   the last chunk to finish (a counter per destination) stores the flag
   ``flags_q[me, slot] = 1`` with a system-scope release. Destinations are read from a
   device pointer table, and a destination whose ``active`` bit is 0 is not written:
   instead the program releases this rank's own wait on it (``flags_me[q, slot] = 1``),
   so a captured graph keeps running after a peer dies, with no re-capture;
2. per peer, a captured ``cuStreamWaitValue32(flags_me[q, slot] == 1)`` (the stream
   waits without occupying an SM) then ``cuStreamWriteValue32(flags_me[q, slot], 0)``
   (reset after use: a wait's value is fixed at capture).

A step is ``layers`` x (dispatch exchange, a matmul standing for the experts, combine
exchange, a matmul standing for attention), captured as one graph. Measured against the
same graph with every exchange replaced by a local copy, in the same processes.

``kill``: world 2; rank 1 is SIGKILLed between replays while rank 0 replays; the
launcher (standing in for the coordinator's EOF) tells rank 0, whose host watchdog
clears ``active[1]`` and releases every wait on rank 1 from a side stream. Reported:
the time from the kill to rank 0's blocked replay ending, that replays afterwards give
the right rows for rank 0's own region, and the GPU memory freed once rank 0 drops its
mappings of the dead rank's buffers.

Run on a GPU machine: ``python -m bench.spike_stream_wait --out DIR``. One JSON line per
configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

H = 2048  # row width (bf16): Qwen3-30B-A3B's hidden size
STAGE_S = 30.0  # a stage that takes longer is reported as hung (the GPU wait never ended)


def _log(me: int, msg: str) -> None:
    print(f"[rank {me} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _wait(me: int, stage: str, limit_s: float = STAGE_S) -> None:
    """Wait for this process's queued GPU work, polling, so a wait that never ends
    raises TimeoutError naming the stage instead of hanging the process."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > limit_s:
            raise TimeoutError(f"rank {me}: GPU work of stage {stage!r} unfinished "
                               f"after {limit_s} s")
        time.sleep(0.0005)
    _log(me, f"{stage} done in {time.time() - t0:.3f} s")


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # older cuda-python layout
        from cuda import cuda as driver
    return driver


def _check(res) -> None:
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def send_kernel(src_ptr, rows_elems, table_ptr, active_ptr, counter_ptr, my_flags_ptr,
                    me, slot, n_slots, phase, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
        q = tl.program_id(0)
        c = tl.program_id(1)
        alive = tl.load(active_ptr + q)
        if alive != 0:
            dest = tl.load(table_ptr + 3 * q + phase).to(tl.pointer_type(tl.bfloat16))
            flags = tl.load(table_ptr + 3 * q + 2).to(tl.pointer_type(tl.int32))
            per = tl.cdiv(rows_elems, CHUNKS)
            lo = c * per
            hi = tl.minimum(lo + per, rows_elems)
            for off in range(lo, hi, BLOCK):
                idx = off + tl.arange(0, BLOCK)
                m = idx < hi
                v = tl.load(src_ptr + q * rows_elems + idx, mask=m)
                tl.store(dest + me * rows_elems + idx, v, mask=m)
            tl.debug_barrier()
            if CHUNKS == 1:
                if q != me:
                    tl.atomic_xchg(flags + me * n_slots + slot, 1, sem="release", scope="sys")
            else:
                done = tl.atomic_add(counter_ptr + q, 1, sem="acq_rel", scope="sys")
                if done == CHUNKS - 1:
                    tl.store(counter_ptr + q, 0)
                    if q != me:
                        tl.atomic_xchg(flags + me * n_slots + slot, 1, sem="release",
                                       scope="sys")
        else:
            if c == 0:
                tl.atomic_xchg(my_flags_ptr + q * n_slots + slot, 1, sem="release",
                               scope="sys")

    return send_kernel


class Exchange:
    """One rank's side: its buffers, the peers' mapped buffers, and the capture calls."""

    def __init__(self, me: int, world: int, rows: int, n_slots: int, chunks: int) -> None:
        self.me, self.world, self.rows, self.n_slots, self.chunks = me, world, rows, n_slots, chunks
        # one receive buffer per phase (dispatch, combine): a peer that is one phase
        # ahead may already write its combine rows while this rank still reads its
        # dispatch rows, never the next layer's dispatch (that needs this rank's combine)
        self.recv = torch.zeros(2, world, rows, H, dtype=torch.bfloat16, device="cuda")
        self.flags = torch.zeros(world, n_slots, dtype=torch.int32, device="cuda")
        self.counter = torch.zeros(world, dtype=torch.int32, device="cuda")
        self.active = torch.ones(world, dtype=torch.int32, device="cuda")
        self.table = torch.zeros(world, 3, dtype=torch.int64, device="cuda")
        self.peers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.send_kernel = _kernels()
        self.cu = _driver()

    def map_peers(self, peers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.peers = peers
        rows = []
        for q in range(self.world):
            recv, flags = (self.recv, self.flags) if q == self.me else peers[q]
            rows.append([recv[0].data_ptr(), recv[1].data_ptr(), flags.data_ptr()])
        self.table.copy_(torch.tensor(rows, dtype=torch.int64))

    def exchange(self, send: torch.Tensor, slot: int, phase: int) -> torch.Tensor:
        """send: [world, rows, H] bf16 (rows for each destination); returns this phase's
        receive buffer [world, rows, H] (row block q came from rank q)."""
        self.send_kernel[(self.world, self.chunks)](
            send, self.rows * H, self.table, self.active, self.counter, self.flags,
            self.me, slot, self.n_slots, phase, CHUNKS=self.chunks, BLOCK=1024)
        stream = self.cu.CUstream(torch.cuda.current_stream().cuda_stream)
        eq = self.cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
        wr = self.cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        for q in range(self.world):
            if q == self.me:
                continue
            addr = self.cu.CUdeviceptr(self.flags[q, slot].data_ptr())
            _check(self.cu.cuStreamWaitValue32(stream, addr, 1, eq))
            _check(self.cu.cuStreamWriteValue32(stream, addr, 0, wr))
        return self.recv[phase]

    def release(self, q: int, stream: torch.cuda.Stream) -> None:
        """Host watchdog: mark q inactive and release every wait on it, with stream
        memory writes on a side stream (no kernel launch)."""
        cs = self.cu.CUstream(stream.cuda_stream)
        wr = self.cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        _check(self.cu.cuStreamWriteValue32(
            cs, self.cu.CUdeviceptr(self.active[q].data_ptr()), 0, wr))
        for slot in range(self.n_slots):
            _check(self.cu.cuStreamWriteValue32(
                cs, self.cu.CUdeviceptr(self.flags[q, slot].data_ptr()), 1, wr))
        stream.synchronize()

    def unmap(self, q: int) -> None:
        """Point q's table entry at this rank's own buffers and drop the mapping."""
        self.table[q].copy_(self.table[self.me])
        torch.cuda.synchronize()
        self.peers.pop(q, None)
        torch.cuda.ipc_collect()


def _step(ex: Exchange | None, send: torch.Tensor, w: torch.Tensor, layers: int,
          local: torch.Tensor) -> torch.Tensor:
    """layers x (dispatch, experts matmul, combine, attention matmul)."""
    x = send
    for layer in range(layers):
        recv = ex.exchange(x, 2 * layer, 0) if ex is not None else local.copy_(x)
        y = (recv.view(-1, H) @ w).view_as(recv)
        back = ex.exchange(y, 2 * layer + 1, 1) if ex is not None else local.copy_(y)
        x = (back.view(-1, H) @ w).view_as(back)
    return x


def replay_ms(g: torch.cuda.CUDAGraph, n: int) -> list[float]:
    """Milliseconds of each of ``n`` replays of ``g`` (CUDA events, one at a time)."""
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def _connected(me: int, world: int, args, queues, rows: int
               ) -> tuple[Exchange, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An Exchange of ``rows`` rows per peer with every peer's buffers mapped (the IPC
    handles travel through the queues), plus its inputs: rows to send, identity
    experts (rows pass unchanged), and the local-copy buffer."""
    ex = Exchange(me, world, rows, 2 * args.layers, args.chunks)
    for q in range(world):
        if q != me:
            queues[q].put((me, ex.recv, ex.flags))
    peers = {}
    for _ in range(world - 1):
        q, recv, flags = queues[me].get(timeout=120)
        peers[q] = (recv, flags)
    ex.map_peers(peers)
    _log(me, f"rows {rows}: mapped {sorted(peers)}")
    send = torch.randn(world, rows, H, dtype=torch.bfloat16, device="cuda") * 0.01
    w = torch.eye(H, dtype=torch.bfloat16, device="cuda")
    return ex, send, w, torch.empty_like(send)


def _rank(me: int, world: int, args, queues, bqueues, results, kill_pipe) -> None:
    try:
        torch.cuda.set_device(0)
        torch.manual_seed(me)
        out = {"rank": me, "world": world}
        for rows in args.rows:
            ex, send, w, local = _connected(me, world, args, queues, rows)
            torch.cuda.synchronize()
            # one eager exchange first (compiles the kernel), then a whole eager step.
            # Its slot is the step's last: a slot is reused only after another exchange
            # of every rank, else a peer's next signal can land before the reset
            ex.exchange(send, 2 * args.layers - 1, 1)
            _wait(me, "one eager exchange")
            _step(ex, send, w, 1, local)
            _wait(me, "eager step")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            graphs = {}
            for name, e in (("exchange", ex), ("local", None)):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
                    res = _step(e, send, w, args.layers, local)
                graphs[name] = (g, res)
            torch.cuda.synchronize()
            _log(me, "captured")
            graphs["exchange"][0].replay()
            _wait(me, "first replay")
            row = {"rows_per_peer": rows, "layers": args.layers,
                   "exchanges_per_step": 2 * args.layers}
            for name in ("exchange", "local"):
                g, res = graphs[name]
                for _ in range(3):
                    g.replay()
                _wait(me, f"{name} warm replays")
                times = replay_ms(g, args.replays)
                row[f"{name}_step_ms"] = round(statistics.median(times), 3)
                row[f"{name}_step_ms_min_max"] = [round(min(times), 3), round(max(times), 3)]
            # correctness: with identity experts, the rows that came back to this rank
            # from q are the rows it sent to q (dispatch then combine returns them)
            g, res = graphs["exchange"]
            g.replay()
            _wait(me, "check replay")
            row["roundtrip_rows_equal"] = bool(torch.equal(res, send))
            row["per_exchange_us"] = round(
                (row["exchange_step_ms"] - row["local_step_ms"]) * 1e3 / (2 * args.layers), 2)
            row["bytes_per_exchange_per_rank"] = (world - 1) * rows * H * 2
            out.setdefault("rows", []).append(row)
            torch.cuda.synchronize()
            del graphs, res
            queues_barrier(bqueues, me, world)
            ex.peers.clear()
            del ex
            torch.cuda.ipc_collect()
        results.put(out)
        if kill_pipe is not None:
            _kill_phase(me, world, args, queues, results, kill_pipe)
    except Exception:  # noqa: BLE001 - reported to the launcher, which prints it
        results.put({"rank": me, "error": traceback.format_exc()[-3000:]})


def queues_barrier(bqueues, me: int, world: int) -> None:
    for q in range(world):
        if q != me:
            bqueues[q].put(me)
    for _ in range(world - 1):
        bqueues[me].get(timeout=120)


def _kill_phase(me, world, args, queues, results, kill_pipe) -> None:
    ex, send, w, local = _connected(me, world, args, queues, 16)
    _step(ex, send, w, 1, local)
    _wait(me, "kill phase: eager step")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
        res = _step(ex, send, w, args.layers, local)
    torch.cuda.synchronize()
    for _ in range(5):
        g.replay()
    _wait(me, "kill phase: replays")
    kill_pipe.send(("ready", me, os.getpid()))
    if me != 0:
        while True:  # replay until killed
            g.replay()
            torch.cuda.synchronize()
    side = torch.cuda.Stream()
    released_at: list[float] = []

    def watchdog() -> None:
        msg = kill_pipe.recv()  # ("dead", q, t_kill)
        _log(me, f"watchdog: rank {msg[1]} is dead, releasing")
        ex.release(msg[1], side)
        released_at.append(time.time())
        _log(me, "watchdog: released")

    th = threading.Thread(target=watchdog, daemon=True)
    th.start()
    n_before = 0
    t_end = None
    deadline = time.time() + 30
    while time.time() < deadline:
        g.replay()
        try:
            ev = torch.cuda.Event()
            ev.record()
            t0 = time.time()
            while not ev.query():
                if time.time() - t0 > 40:
                    raise TimeoutError("the replay blocked on the dead rank was not released")
                time.sleep(0.0002)
        except TimeoutError as exc:
            results.put({"rank": 0, "kill": {"error": str(exc), "released": bool(released_at)}})
            return
        n_before += 1
        if released_at:
            t_end = time.time()
            break
    free_before = torch.cuda.mem_get_info()[0]
    after = replay_ms(g, 20)
    ok = bool(torch.equal(res[me], send[me]))
    ex.unmap(1)
    torch.cuda.ipc_collect()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    ok_after_unmap = bool(torch.equal(res[me], send[me]))
    free_after = torch.cuda.mem_get_info()[0]
    results.put({"rank": 0, "kill": {"replays_before_release": n_before,
                                      "blocked_replay_end_time": t_end,
                                      "released_time": released_at[0] if released_at else None,
                                      "step_ms_after": round(statistics.median(after), 3),
                                      "own_rows_correct": ok,
                                      "own_rows_correct_after_unmap": ok_after_unmap,
                                      "gpu_mem_freed_by_unmap_mib":
                                          round((free_after - free_before) / 2**20, 1)}})


def run_world(world: int, args, kill: bool) -> list[dict]:
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(world)]
    bqueues = [ctx.Queue() for _ in range(world)]
    results = ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(world)] if kill else [(None, None)] * world
    procs = [ctx.Process(target=_rank, args=(r, world, args, queues, bqueues, results, pipes[r][1]),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in range(world):
            r = results.get(timeout=args.timeout)
            print(json.dumps({"partial": r})[:3000], file=sys.stderr, flush=True)
            out.append(r)
            if "error" in r:
                return out
        if kill:
            ready = [pipes[r][0].recv() for r in range(world)]
            time.sleep(0.5)
            t_kill = time.time()
            os.kill(procs[1].pid, signal.SIGKILL)
            pipes[0][0].send(("dead", 1, t_kill))  # as the coordinator's EOF would
            procs[1].join(30)
            t_seen = time.time()
            print(f"launcher: rank 1 reaped {t_seen - t_kill:.3f} s after the kill",
                  file=sys.stderr, flush=True)
            res = results.get(timeout=args.timeout)
            k = res.get("kill", res)
            if "blocked_replay_end_time" in k and k["blocked_replay_end_time"]:
                k["kill_to_release_ms"] = round((k["released_time"] - t_kill) * 1e3, 2)
                k["kill_to_survivor_step_end_ms"] = round(
                    (k["blocked_replay_end_time"] - t_kill) * 1e3, 2)
                k["launcher_reaped_ms"] = round((t_seen - t_kill) * 1e3, 2)
            out.append({"ready": ready, **res})
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--rows", default="1,16,128", help="rows sent to each peer per exchange")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--chunks", type=int, default=8, help="CTAs per destination")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.rows = [int(x) for x in args.rows.split(",")]
    lines = []
    for world in [int(x) for x in args.worlds.split(",")]:
        kill = world == 2 and not args.no_kill
        try:
            res = run_world(world, args, kill)
        except Exception:  # noqa: BLE001 - one world's failure, not the run
            res = [{"error": traceback.format_exc()[-3000:]}]
        line = {"section": "stream_wait_spike", "world": world, "results": res}
        print(json.dumps(line), flush=True)
        lines.append(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "spike_stream_wait.jsonl"), "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    sys.exit(main())
