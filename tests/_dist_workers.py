"""Worker bodies for the multi-process tests of elasticep.distributed (not a test module).

Workers are started through a 'forkserver' context that preloads torch and the package,
so each start is a cheap fork of a thread-free server. Results go back on a per-worker
Pipe (never a shared Queue: a SIGKILLed writer would leave its lock held) as
(rank, kind, payload) tuples; `q` is the write end with a `put` method.
"""

from __future__ import annotations

import os
import threading
import time
import traceback

import torch
import torch.distributed as dist

import elasticep.distributed as ed
from elasticep.distributed.op_injection import FinishLate, inject
from elasticep.utils.wait import wait_until
from elasticep_testkit.admission import agree_ready


def _init(rank, addr, ws, mws, ext, on_failure="complete"):
    return ed.init_process_group(addr, rank, ws, max_world_size=mws, is_extension=ext,
                                 timeout_s=20.0, on_failure=on_failure)


class _Out:
    def __init__(self, conn):
        self.conn = conn

    def put(self, item):
        self.conn.send(item)


def main(rank, addr, ws, mws, ext, scenario, conn, args):
    """Entry point of every worker process; runs `scenario` and reports errors."""
    q = _Out(conn)
    try:
        globals()[scenario](rank, addr, ws, mws, ext, q, **args)
    except BaseException as e:  # report, never hang the parent
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        q.put((rank, "exit", None))
        os._exit(0)  # skip interpreter teardown of Gloo threads


def allreduce_loop(rank, addr, ws, mws, ext, q, duration_s=3.0, idle_group=False):
    """all_reduce(rank + 1) in a loop; reports ("sum", (i, sum, time, epoch, mask)), and
    at the end ("listener", [has_pending_change() at each change-listener call]).

    With idle_group, an extra group that never runs an op reports its epoch and mask at
    the end. An ElasticError is reported as ("raised", name) and ends the loop.
    """
    _init(rank, addr, ws, mws, ext)
    idle = None
    if idle_group:
        idle = dist.new_group(list(range(ws)), backend="elastic",
                              pg_options=ed.BackendOptions(unique_name="idle"))
    seen: list[bool] = []  # has_pending_change() at each call of the change listener
    ed.add_change_listener(None, lambda: seen.append(ed.has_pending_change()))
    q.put((rank, "ready", os.getpid()))
    t_end = time.monotonic() + duration_s
    i = 0
    try:
        while True:
            # element 1 is a stop vote, so every survivor stops after the same op
            t = torch.tensor([float(rank + 1), float(time.monotonic() > t_end)])
            dist.all_reduce(t)
            q.put((rank, "sum", (i, float(t[0]), time.time(), ed.get_current_epoch(),
                                 ed.get_active_ranks().tolist())))
            i += 1
            if t[1] > 0:
                break
            time.sleep(0.002)
    except ed.ElasticError as e:
        q.put((rank, "raised", (type(e).__name__, time.time())))
        return
    q.put((rank, "listener", list(seen)))
    q.put((rank, "done", (ed.get_current_epoch(), ed.get_active_ranks().tolist())))
    if idle is not None:
        q.put((rank, "idle", (ed.get_current_epoch(idle), ed.get_active_ranks(idle).tolist())))
    time.sleep(1.5)  # let the others report before this exit changes membership


def step_loop(rank, addr, ws, mws, ext, q, duration_s=3.0, watch=(), die_in_recover=None,
              die_in_join=False, on_failure="complete"):
    """Lockstep steps: a header all_reduce agrees on admitting `watch` slots, then a data
    all_reduce(rank + 1). A joiner (ext) joins first and enters at the header.

    Reports ("sum", (i, sum, epoch, mask)), ("pause", seconds from recover_ranks to the
    next data result), ("joined", time).
    """
    _init(rank, addr, ws, mws, ext, on_failure)
    if ext:
        if die_in_join:
            threading.Timer(0.05, os._exit, (3,)).start()
        ed.join_group(timeout_s=20.0)
        q.put((rank, "joined", time.time()))
    q.put((rank, "ready", os.getpid()))
    t_end = time.monotonic() + duration_s
    i, t_rec = 0, None
    while True:
        agreed = agree_ready(watch, mws)
        if agreed:
            if rank == die_in_recover:
                threading.Timer(0.003, os._exit, (3,)).start()
            t_rec = time.monotonic()
            admitted = ed.recover_ranks(None, agreed)
            q.put((rank, "recovered", admitted))
            continue  # the joiner's first op is the next header
        t = torch.tensor([float(rank + 1), float(time.monotonic() > t_end)])
        dist.all_reduce(t)
        if t_rec is not None:
            q.put((rank, "pause", time.monotonic() - t_rec))
            t_rec = None
        q.put((rank, "sum", (i, float(t[0]), ed.get_current_epoch(),
                             ed.get_active_ranks().tolist())))
        i += 1
        if t[1] > 0:
            break
        time.sleep(0.002)
    q.put((rank, "done", (ed.get_current_epoch(), ed.get_active_ranks().tolist(),
                          dist.get_world_size())))
    time.sleep(1.5)


def engine_steps(rank, addr, ws, mws, ext, q, duration_s=3.0, hold=None):
    """The engine's step shape on a raise-mode WORLD: header all_reduce, all_to_all_single
    (counts, then uneven data), commit all_reduce. A RankFailureError redoes the step.

    Reports ("commit", (step, commit_value, epoch)) and ("raised", (step, op)). With
    hold=(rank, step) that rank finishes that step's commit op 1 s late.
    """
    _init(rank, addr, ws, mws, ext, "raise")
    q.put((rank, "ready", os.getpid()))
    t_end = time.monotonic() + duration_s
    step = 0
    while True:
        op = "header"
        try:
            h = torch.tensor([float(step)])
            dist.all_reduce(h, op=dist.ReduceOp.MAX)
            mask = ed.get_active_ranks().tolist()
            op = "a2a"
            send = torch.tensor([(rank + d + step) % 3 if mask[d] else 0 for d in range(mws)])
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, [1] * mws, [1] * mws)
            data = torch.full((int(send.sum()), 2), float(rank))
            out = torch.empty((int(recv.sum()), 2))
            dist.all_to_all_single(out, data, recv.tolist(), send.tolist())
            op = "commit"
            if hold is not None and (rank, step) == tuple(hold):
                inject(None, FinishLate(1.0))  # finish this commit op late
                q.put((rank, "holding", step))
            c = torch.tensor([out.sum().item() + 1000.0 * step,
                              float(time.monotonic() > t_end)])
            dist.all_reduce(c)
        except ed.RankFailureError:
            q.put((rank, "raised", (step, op)))
            continue
        q.put((rank, "commit", (step, float(c[0]), ed.get_current_epoch())))
        step += 1
        if c[1] > 0:
            break
    q.put((rank, "done", ed.get_current_epoch()))
    time.sleep(1.5)


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32,
          torch.int64, torch.bool]
OPS = ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]


def make_input(rank: int, dtype: torch.dtype, n: int, salt: int = 0) -> torch.Tensor:
    """Deterministic per-rank input; floats in [0.5, 1.5) keep PRODUCT well-conditioned."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return torch.randint(-4, 5, (n,), generator=g, dtype=dtype)


def reference_reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Single-process reference of all_reduce over inputs xs (same emulation contract)."""
    dtype = xs[0].dtype
    if dtype == torch.bool:
        st = torch.stack(xs)
        return st.any(0) if op in ("SUM", "MAX") else st.all(0)
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    st = torch.stack([x.to(wide) for x in xs])
    r = {"SUM": st.sum(0), "AVG": st.sum(0), "MAX": st.max(0).values,
         "MIN": st.min(0).values, "PRODUCT": st.prod(0)}[op]
    if op == "AVG":
        r = r / len(xs) if dtype.is_floating_point else torch.div(r, len(xs),
                                                                  rounding_mode="floor")
    return r.to(dtype)


def _check(bad: list, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    try:
        if got.dtype in (torch.bfloat16, torch.float16):
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        bad.append(f"{name}: {str(e)[:200]}")


def collectives(rank, addr, ws, mws, ext, q, leaver=None):
    """Every op and dtype against a reference; then `leaver` exits and the survivors check
    the hole rules (zero splits in all_to_all_single, zero-fill in all_gather)."""
    _init(rank, addr, ws, mws, ext)
    bad: list[str] = []
    ranks = list(range(ws))
    for phase in ("full", "holes"):
        if phase == "holes":
            dist.barrier()
            if rank == leaver:
                os._exit(0)
            wait_until(lambda: ed.get_active_ranks()[leaver] == 0, 15,
                       f"slot {leaver} to leave", poll_s=0.01)
            ranks = [r for r in ranks if r != leaver]
        mask = ed.get_active_ranks().tolist()
        for dtype in DTYPES:
            for op in OPS:
                x = make_input(rank, dtype, 5)
                if dtype == torch.bool and op == "AVG":
                    try:
                        dist.all_reduce(x, op=dist.ReduceOp.AVG)
                        bad.append("bool AVG did not raise")
                    except ValueError:
                        pass
                    continue
                dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                _check(bad, f"{phase} all_reduce {dtype} {op}", x,
                       reference_reduce([make_input(r, dtype, 5) for r in ranks], op))
            # broadcast from the last active rank (never rank 0 by default)
            root = ranks[-1]
            b = make_input(rank, dtype, 3, 1)
            dist.broadcast(b, src=root)
            _check(bad, f"{phase} broadcast {dtype}", b, make_input(root, dtype, 3, 1))
            # all_gather (list) and all_gather_into_tensor: zero-fill inactive slots
            outs = [torch.ones(2, dtype=dtype) for _ in range(mws)]
            dist.all_gather(outs, make_input(rank, dtype, 2, 2))
            want = [make_input(r, dtype, 2, 2) if mask[r] else torch.zeros(2, dtype=dtype)
                    for r in range(mws)]
            for r in range(mws):
                _check(bad, f"{phase} all_gather {dtype} slot {r}", outs[r], want[r])
            big = torch.ones(2 * mws, dtype=dtype)
            dist.all_gather_into_tensor(big, make_input(rank, dtype, 2, 2))
            _check(bad, f"{phase} all_gather_into_tensor {dtype}", big, torch.cat(want))
            # reduce_scatter_tensor (SUM)
            if dtype != torch.bool:
                rs = torch.empty(2, dtype=dtype)
                dist.reduce_scatter_tensor(rs, make_input(rank, dtype, 2 * mws, 3))
                full = reference_reduce([make_input(r, dtype, 2 * mws, 3) for r in ranks],
                                        "SUM")
                _check(bad, f"{phase} reduce_scatter {dtype}", rs, full[2 * rank:2 * rank + 2])
            # all_to_all_single with uneven splits; inactive slots get zero splits
            def split(src, dst, mask=mask):
                return 0 if not (mask[src] and mask[dst]) else (src + 2 * dst) % 4
            in_s = [split(rank, d) for d in range(mws)]
            out_s = [split(s_, rank) for s_ in range(mws)]
            inp = make_input(rank, dtype, sum(in_s) * 3, 4).reshape(-1, 3)
            out = torch.ones((sum(out_s), 3), dtype=dtype)
            dist.all_to_all_single(out, inp, out_s, in_s)
            exp = []
            for s_ in range(mws):
                if not out_s[s_]:
                    continue
                src_in = make_input(s_, dtype, sum(split(s_, d) for d in range(mws)) * 3,
                                    4).reshape(-1, 3)
                off = sum(split(s_, d) for d in range(rank))
                exp.append(src_in[off:off + out_s[s_]])
            if exp:
                _check(bad, f"{phase} all_to_all_single {dtype}", out, torch.cat(exp))
        dist.barrier()
        q.put((rank, phase + " counters", ed.group_diagnostics()["counters"]))
        if len(ranks) > 1:  # send / recv ring among active ranks (none for one member)
            nxt = ranks[(ranks.index(rank) + 1) % len(ranks)]
            prv = ranks[ranks.index(rank) - 1]
            buf = torch.zeros(4, dtype=torch.bfloat16)
            if ranks.index(rank) % 2 == 0:
                dist.send(make_input(rank, torch.bfloat16, 4, 5), nxt)
                dist.recv(buf, prv)
            else:
                dist.recv(buf, prv)
                dist.send(make_input(rank, torch.bfloat16, 4, 5), nxt)
            _check(bad, f"{phase} send/recv", buf, make_input(prv, torch.bfloat16, 4, 5))
        q.put((rank, phase, (bad[:], mask, dist.get_world_size())))



def removal_loop(rank, addr, ws, mws, ext, q, duration_s=30.0):
    """Data all_reduce loop whose header agrees on supervisor removal requests; the ranks
    then call deactivate_ranks at the same step boundary. Reports ("sum", (i, sum)),
    ("removed", step) and ("raised", name). The loop runs ``duration_s`` seconds from the
    moment every rank is up (ranks start seconds apart on a loaded machine)."""
    _init(rank, addr, ws, mws, ext)
    q.put((rank, "ready", os.getpid()))
    dist.barrier()
    t_end = time.monotonic() + duration_s
    i = 0
    try:
        while True:
            req = ed.get_pending_requests()["remove"]
            h = torch.zeros(mws)
            h[req] = 1.0
            dist.all_reduce(h, op=dist.ReduceOp.MAX)
            if h.sum() > 0:
                ed.deactivate_ranks(None, [s for s in range(mws) if h[s] > 0])
                q.put((rank, "removed", i))
                continue
            t = torch.tensor([float(rank + 1), float(time.monotonic() > t_end)])
            dist.all_reduce(t)
            q.put((rank, "sum", (i, float(t[0]), ed.get_active_ranks().tolist())))
            i += 1
            if t[1] > 0:
                break
            time.sleep(0.005)
    except ed.ElasticError as e:
        q.put((rank, "raised", type(e).__name__))
        return
    q.put((rank, "done", ed.get_active_ranks().tolist()))
    time.sleep(1.5)


def p2p_async(rank, addr, ws, mws, ext, q):
    """isend/irecv in any order on 3 ranks: a ring where everyone sends first, four
    ordered bf16 sends, then slot 2 exits and 0<->1 still exchange while their
    transfers with slot 2 fail. Reports ("ring", v), ("ordered", [..]), ("dead", (..))."""
    _init(rank, addr, ws, mws, ext)
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    out, inp = torch.tensor([rank * 10]), torch.zeros(1, dtype=torch.int64)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt),
                                     dist.P2POp(dist.irecv, inp, prv)]):
        w.wait()
    q.put((rank, "ring", int(inp)))
    if rank in (0, 1):
        bufs = [torch.full((3,), float(i) + 0.5, dtype=torch.bfloat16) if rank == 0
                else torch.zeros(3, dtype=torch.bfloat16) for i in range(4)]
        op = dist.isend if rank == 0 else dist.irecv
        for w in dist.batch_isend_irecv([dist.P2POp(op, b, 1 - rank) for b in bufs]):
            w.wait()
        q.put((rank, "ordered", [b.tolist() for b in bufs]))
    dist.barrier()
    if rank == 2:
        os._exit(0)
    dead = []
    for w in (dist.isend(torch.ones(1), 2), dist.irecv(torch.ones(1), 2)):
        try:
            w.wait()
            dead.append("completed")
        except ed.RankFailureError as e:
            dead.append(e.dead_ranks)
    got = torch.zeros(1)
    ws_ = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, 1 - rank),
                                  dist.P2POp(dist.isend, torch.tensor([rank + 7.0]), 1 - rank)])
    for w in ws_:
        w.wait()
    q.put((rank, "dead", (dead, float(got))))


def rooted_ops(rank, addr, ws, mws, ext, q, root_late_s=0.0):
    """gather / scatter / reduce to root 1 on a group with a hole (capacity mws > ws).
    Reports ("rooted", (gathered or None, scattered, reduced)). ``root_late_s``: the
    root marks its reduce completed that late (the others are done by then)."""
    _init(rank, addr, ws, mws, ext)
    t = torch.tensor([rank + 1.0, -rank])
    outs = [torch.full((2,), -9.0) for _ in range(mws)] if rank == 1 else None
    dist.gather(t, outs, dst=1)
    piece = torch.zeros(2, dtype=torch.int32)
    parts = [torch.tensor([10 * s, 10 * s + 1], dtype=torch.int32) for s in range(mws)]
    dist.scatter(piece, parts if rank == 1 else None, src=1)
    red = torch.tensor([float(rank + 1)])
    if rank == 1:
        inject(None, FinishLate(root_late_s))
    dist.reduce(red, dst=1, op=dist.ReduceOp.MAX)
    # Each worker exits once it has reported, and the coordinator takes an exit for a
    # death: a peer that had not yet marked the reduce completed (a root slow under
    # load) would redo it over the survivors (on_failure="complete") and get the MAX of
    # fewer ranks. Nobody leaves this barrier before every rank completed the reduce.
    dist.barrier()
    q.put((rank, "rooted", ([o.tolist() for o in outs] if outs else None, piece.tolist(),
                            float(red))))


def reinit_world(rank, addr, ws, mws, ext, q):
    """all_reduce, destroy WORLD, init it again in the same process, all_reduce again.
    The extension slot first tries an op on WORLD it has not joined. Reports ("sums",
    (first, second)) and, from the joiner, ("not_joined", message)."""
    if ext:
        _init(rank, addr, ws, mws, ext)
        try:
            dist.all_reduce(torch.ones(1))
        except ValueError as e:
            q.put((rank, "not_joined", str(e)))
        return
    sums = []
    for _ in range(2):
        _init(rank, addr, ws, mws, ext)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        sums.append(float(t))
        if len(sums) == 2:  # before the exit (a death): as in rooted_ops
            dist.barrier()
        dist.destroy_process_group()
    q.put((rank, "sums", tuple(sums)))


def _mooncake_init(rank, port, ws, **opts):
    """Start as a Mooncake PG user does: env:// rendezvous, no coordinator given."""
    from elasticep.compat.mooncake import pg

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("mooncake-cpu", rank=rank, world_size=ws,
                            pg_options=pg.MooncakeBackendOptions(**opts))
    return pg, dist.group.WORLD


def mooncake_reinit_late_root(rank, port, ws, mws, ext, q, flags=""):
    """A Mooncake user's script: all_reduce, destroy WORLD and init it again, all_reduce
    and a send from slot 0 to each other slot, destroy. Every other rank has finished its
    second init before rank 0 destroys the first WORLD (rank 0 waits for their flag
    files in `flags`). Reports ("sums", (first, second, received))."""
    from datetime import timedelta

    from elasticep.compat.mooncake import pg

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sums = []
    for i in range(2):
        if i == 1:
            deadline = time.monotonic() + 20
            while rank == 0 and not all(os.path.exists(f"{flags}/{r}") for r in range(1, ws)):
                assert time.monotonic() < deadline, "the other ranks never re-initialised"
                time.sleep(0.05)
            dist.destroy_process_group()
        dist.init_process_group("mooncake-cpu", rank=rank, world_size=ws,
                                pg_options=pg.MooncakeBackendOptions(ws),
                                timeout=timedelta(seconds=10))
        if i == 1 and rank:
            open(f"{flags}/{rank}", "w").close()
        t = torch.tensor([rank + 1])
        dist.all_reduce(t)
        sums.append(int(t))
    got = torch.tensor([7 * rank])
    for r in range(1, ws):
        if rank == 0:
            dist.send(torch.tensor([7 * r]), r)
        elif rank == r:
            dist.recv(got, 0)
    q.put((rank, "sums", (*sums, int(got))))
    dist.destroy_process_group()


def mooncake_extension(rank, port, ws, mws, ext, q):
    """Slots 0, 1 start (capacity 3); slot 2 joins. Reports ("sizes", ...) per phase, the
    joiner's solo all_reduce, and the coordinator address ("coord", address)."""
    from elasticep.distributed import api

    if not ext:
        pg, world = _mooncake_init(rank, port, ws, max_group_size=mws)
        q.put((rank, "coord", api.control_address()))
        got = torch.zeros(ws, dtype=torch.int32)
        dist.all_gather_into_tensor(got, torch.tensor([rank + 1], dtype=torch.int32))
        before = (dist.get_world_size(), got.tolist())
        wait_until(lambda: pg.get_peer_state(world, [2])[0], 30, "the joiner to be ready")
        status = pg.recover_ranks(world, [2]).status
    else:
        pg, world = _mooncake_init(rank, port, mws, max_group_size=mws, is_extension=True)
        solo = torch.tensor([5])
        dist.all_reduce(solo)
        before, status = (dist.get_world_size(), int(solo)), None
        pg.join_group(world)
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    outs = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(outs, torch.tensor([rank * 10]))
    rs = torch.zeros(1, dtype=torch.int64)
    dist.reduce_scatter_tensor(rs, torch.arange(3) + rank)
    q.put((rank, "sizes", (before, status and status.name, dist.get_world_size(), int(t),
                           [int(o) for o in outs], int(rs))))
    dist.destroy_process_group()


def mooncake_manual(rank, port, ws, mws, ext, q):
    """Manual membership on 3 ranks; slot 2 exits after one op. Survivors report
    ("manual", per-round (value, local_success, hint, active mask)) and the sync and
    deactivate statuses."""
    pg, world = _mooncake_init(rank, port, ws, max_group_size=ws,
                               auto_deactivate_on_failure=False, auto_sync_on_failure=False)

    def round_():
        t = torch.tensor([rank + 1])
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        return (int(t), pg.get_local_success(w), pg.get_failed_ranks_hint(w).tolist(),
                pg.get_active_ranks(world).tolist())

    rows = [round_()]
    if rank == 2:
        os._exit(0)
    wait_until(lambda: not pg.get_peer_state(world, [2])[0], 30, "the death of slot 2")
    rows.append(round_())
    probe = dist.isend(torch.ones(1), 2)
    probe.wait()
    sync = pg.sync_after_failure(world).status.name
    resp = pg.deactivate_ranks(world, [2])
    rows.append(round_())
    q.put((rank, "manual", (rows, pg.get_local_success(probe), sync, resp.status.name)))
