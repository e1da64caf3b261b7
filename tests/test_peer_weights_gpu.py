"""Expert moves through CUDA IPC between two processes on one GPU
(elasticep.moe.peer_weights; GPU only).

Rank 1 leaves (a scale-down EP2 -> EP1): rank 0 copies rank 1's experts device to
device from rank 1's mapped tensors, with no collective, and ends with exactly the
experts the new placement gives it. After the "commit", each rank drops its old tensors and
both ranks publish again: the old tensors' memory comes back on both, including rank
0's, which were shared but never opened (their IPC counters are given back, so nothing
stays in torch's limbo of shared blocks).

Rank 1 is SIGKILLed after rank 0 mapped it: rank 0's repair copies rank 1's orphans
from its still-mapped memory (no checkpoint read), equal to what rank 1 held; the next
refresh drops the mapping.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from datetime import timedelta

import pytest
import torch

from elasticep_testkit.harness.serve_process import free_port

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(240)]

E, N, L = 8, 2, 3
ROWS13, H, INTER = 512, 256, 256  # w13 [S, 2*I, H], w2 [S, H, I]: 256 KiB per w13 slot in fp32


def _value(layer: int, expert: int) -> float:
    return 1000.0 * layer + expert + 1


def _worker(scenario, rank: int, port: int, out) -> None:
    try:
        out.put((rank, scenario(rank, port)))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def _setup(rank: int, port: int):
    """Both ranks: the store, the EP2 launch placement, this rank's tensors (each slot
    filled with its expert's value) published, and the peer's published too."""
    import torch.distributed as dist

    from elasticep.eplb.placement import initial_placement
    from elasticep.moe.peer_weights import PeerWeights

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    old = initial_placement(L, E, 0, N, max_ep_size=N)
    local = old.local(rank)
    w13 = [torch.stack([torch.full((ROWS13, H), _value(layer, e)) for e in local[layer].tolist()]
                       ).cuda() for layer in range(L)]
    w2 = [-t[:, :H, :INTER].clone() for t in w13]
    peers = PeerWeights(rank, store)
    peers.publish(w13, w2)
    store.set(f"published/{rank}", "1")
    store.wait([f"published/{1 - rank}"])
    return store, old, w13, w2, peers


def _wrong_slot(new, rank: int, n13, n2) -> str | None:
    """The first slot of ``rank`` that does not hold the expert ``new`` puts there."""
    mine = new.local(rank)
    for layer in range(L):
        for j, e in enumerate(mine[layer].tolist()):
            if e != new.empty and not (torch.all(n13[layer][j] == _value(layer, e))
                                       and torch.all(n2[layer][j] == -_value(layer, e))):
                return f"rank {rank}: layer {layer} slot {j} does not hold expert {e}"
    return None


def _leaving(rank: int, port: int) -> str:
    from elasticep.eplb.elastic import plan_expert_loads, scale_down_placement
    from elasticep.moe.weight_transfer import move_expert_weights

    store, old, w13, w2, peers = _setup(rank, port)
    new = scale_down_placement(old, [1])
    plan = plan_expert_loads(old, new, source_ranks=old.active_ranks)
    n13, n2 = move_expert_weights(plan, old, new, rank, w13, w2, group=None, peers=peers)
    peers.end_change()
    if rank == 0 and (wrong := _wrong_slot(new, 0, n13, n2)):
        return wrong
    store.set(f"committed/{rank}", "1")  # the change's commit: every copy is done
    store.wait([f"committed/{1 - rank}"])
    # the swap: the old tensors go, and each rank publishes its new ones (rank 1 has
    # none left); rank 0's old tensors were shared but never opened
    kept = {id(t) for t in n13 + n2}
    nbytes = sum(t.numel() * t.element_size() for t in w13 + w2 if id(t) not in kept)
    before = torch.cuda.memory_allocated()
    del w13, w2
    if rank == 0:
        peers.publish(n13, n2)
    else:
        del n13, n2
        peers.publish([None] * L, [None] * L)
    after = torch.cuda.memory_allocated()
    if before - after < nbytes:
        return (f"rank {rank}: {before - after} of {nbytes} bytes freed after the swap "
                "(shared blocks left in torch's limbo)")
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{1 - rank}"])
    return "ok"


def _killed(rank: int, port: int) -> str:
    import signal
    import time

    from elasticep.eplb.elastic import plan_expert_loads, repair_placement
    from elasticep.moe.weight_transfer import move_expert_weights

    store, old, w13, w2, peers = _setup(rank, port)
    if rank == 1:
        store.wait(["mapped/0"])
        store.set("pid/1", str(os.getpid()))
        torch.cuda.synchronize()
        os.kill(os.getpid(), signal.SIGKILL)
    if peers.refresh([0, 1]) != [1]:
        return "rank 0: refresh did not map rank 1"
    store.set("mapped/0", "1")
    pid = int(store.get("pid/1"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:  # gone, or a zombie its parent (the test) has not reaped yet
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        return "rank 1 did not die"
    time.sleep(0.5)
    new = repair_placement(old, torch.tensor([True, False]))

    def no_checkpoint(layer: int, expert: int):
        raise AssertionError(f"checkpoint read for layer {layer} expert {expert}")

    plan = plan_expert_loads(old, new)
    n13, n2 = move_expert_weights(plan, old, new, 0, w13, w2, group=None,
                                  load_fn=no_checkpoint, peers=peers)
    orphans = sum(x.rank == 0 and x.source_rank is None for x in plan)
    if orphans == 0 or peers.departed_copies != orphans:
        return f"{peers.departed_copies} of {orphans} orphans copied from rank 1's memory"
    if wrong := _wrong_slot(new, 0, n13, n2):
        return wrong
    peers.refresh([0])
    if peers.mapped_ranks:
        return "rank 0 still maps the dead rank after refresh"
    torch.cuda.synchronize()
    return "ok"


def _spawn(scenario, reporting: int) -> dict:
    """Run ``scenario`` as ranks 0 and 1; the results of the first ``reporting`` ranks to
    report (a rank that kills itself reports nothing)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(scenario, r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=180) for _ in range(reporting))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                os.kill(p.pid, 9)


def test_a_dead_rank_s_orphans_are_copied_from_its_still_mapped_memory():
    assert _spawn(_killed, reporting=1) == {0: "ok"}


def test_a_leaving_rank_s_experts_are_copied_from_its_mapped_memory():
    assert _spawn(_leaving, reporting=2) == {0: "ok", 1: "ok"}
