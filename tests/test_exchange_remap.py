"""The same-host exchange's remap after a membership change, on CPU: ``publish`` puts a
new generation of a rank's buffers in the store, ``map_peers`` maps each member's newest
generation once, ``sync_exchange`` unmaps departed ranks, and the step loop goes from a
change raised mid-step (``EpochChangedError``) through the remap to a redo of the same
batch on the new mapping.

CUDA IPC is replaced by a registry: a "handle" names an in-process arena, and an "open"
returns that arena itself (the memory a real open would map) and is counted, so a test
sees which mapping every table row points at and how many opens a sync made. The store
is torch's own in-memory ``HashStore``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import elasticep.distributed as ed
from elasticep.elastic import placement_sync
from elasticep.elastic.exchange_setup import sync_exchange
from elasticep.elastic.fault_injection import FaultInjector
from elasticep.elastic.log_context import RankContext
from elasticep.elastic.step_loop import LockstepLoop, step_header
from elasticep.moe.exchange.ipc_exchange import IpcExchange
from elasticep.utils import cuda_ipc
from tests._loop_fakes import FakeChannel, FakeEngine

G = 4


class FakeIpc:
    """``share``/``open_shared`` over one process: handle -> the shared arena."""

    def __init__(self) -> None:
        self.arenas: dict[bytes, torch.Tensor] = {}
        self.opens: list[bytes] = []

    def share(self, tensor: torch.Tensor) -> bytes:
        handle = f"arena-{len(self.arenas)}".encode()
        self.arenas[handle] = tensor
        return handle

    def open_shared(self, handle: bytes) -> torch.Tensor:
        self.opens.append(handle)
        return self.arenas[handle]


@pytest.fixture
def ipc(monkeypatch) -> FakeIpc:
    fake = FakeIpc()
    monkeypatch.setattr(cuda_ipc, "share", fake.share)
    monkeypatch.setattr(cuda_ipc, "open_shared", fake.open_shared)
    return fake


def exchange(rank: int) -> IpcExchange:
    return IpcExchange(rank, G, 16, 8, torch.float32, 2, "cpu")


def row_of(ex: IpcExchange, arena: torch.Tensor) -> list[int]:
    """The table row (dispatch, combine, flags addresses) of buffers in ``arena``."""
    recv0, recv1, flags, _ = ex._carve(arena)
    return [recv0.data_ptr(), recv1.data_ptr(), flags.data_ptr()]


def mask(*ranks: int) -> torch.Tensor:
    m = torch.zeros(G, dtype=torch.bool)
    m[list(ranks)] = True
    return m


def test_remap_follows_generations_departures_and_relaunches(ipc):
    store = dist.HashStore()
    ranks = {r: exchange(r) for r in range(3)}
    assert [ranks[r].publish(store) for r in range(3)] == [1, 1, 1]
    me = ranks[0]
    own = me.table[0].tolist()
    sync_exchange(me, store, mask(0, 1, 2), timeout_s=1.0)
    assert {q: gen for q, (gen, _) in me.peers.items()} == {1: 1, 2: 1}
    assert me.table[1].tolist() == row_of(me, ranks[1].arena)
    assert me.table[2].tolist() == row_of(me, ranks[2].arena)
    assert len(ipc.opens) == 2 and me.active.tolist() == [1, 1, 1, 0] and not me.solo

    # the same generations again: nothing is opened anew
    assert me.map_peers(store, [0, 1, 2]) == []
    sync_exchange(me, store, mask(0, 1, 2), timeout_s=1.0)
    assert len(ipc.opens) == 2

    # rank 2 departs: its row falls back to this rank's own buffers
    sync_exchange(me, store, mask(0, 1), timeout_s=1.0)
    assert set(me.peers) == {1} and me.table[2].tolist() == own
    assert me.active.tolist() == [1, 1, 0, 0]

    # rank 1 dies and is relaunched: a new process, new memory, generation 2
    relaunched = exchange(1)
    assert relaunched.publish(store) == 2
    sync_exchange(me, store, mask(0, 1), timeout_s=1.0)
    assert me.peers[1][0] == 2 and me.peers[1][1] is relaunched.arena
    assert me.table[1].tolist() == row_of(me, relaunched.arena)
    assert me.table[1].tolist() != row_of(me, ranks[1].arena)
    assert len(ipc.opens) == 3

    # rank 2 comes back under its old generation: mapped again (it was unmapped)
    sync_exchange(me, store, mask(0, 1, 2), timeout_s=1.0)
    assert me.peers[2][0] == 1 and me.table[2].tolist() == row_of(me, ranks[2].arena)
    assert len(ipc.opens) == 4


def test_a_member_that_never_published_times_out(ipc):
    store = dist.HashStore()
    me = exchange(0)
    me.publish(store)
    with pytest.raises(TimeoutError, match=r"ranks \[0, 3\]"):
        sync_exchange(me, store, mask(0, 3), timeout_s=0.05)


class ChangingEngine(FakeEngine):
    """The first forward sees the membership change (rank 2 gone, rank 1 relaunched)
    and raises as a collective of the old epoch would; every forward records the table
    of the exchange it ran on; the first commit ends the loop."""

    def __init__(self, ex: IpcExchange, on_change) -> None:
        super().__init__([[3]])
        self.ex, self.on_change = ex, on_change
        self.tables: list[list[list[int]]] = []
        self.committed: list[int] = []

    def execute(self, batch, while_running=None):
        self.tables.append(self.ex.table.tolist())
        if len(self.tables) == 1:
            self.on_change()
            raise ed.EpochChangedError("a member left mid-step", epoch=2)
        return super().execute(batch, while_running)

    def commit(self, batch, tokens):
        self.committed.append(batch.num_tokens)
        raise ed.RankEvictedError("the test is over: leave the loop")


@pytest.mark.timeout(20)
def test_a_change_mid_step_remaps_then_redoes_the_step_on_the_new_mapping(ipc, monkeypatch):
    store = dist.HashStore()
    ranks = {r: exchange(r) for r in range(3)}
    for ex in ranks.values():
        ex.publish(store)
    me = ranks[0]
    view = SimpleNamespace(epoch=1, active=mask(0, 1, 2))
    sync_exchange(me, store, view.active, timeout_s=1.0)
    relaunched = exchange(1)

    def change() -> None:
        relaunched.publish(store)
        view.epoch, view.active = 2, mask(0, 1)

    monkeypatch.setattr(ed, "get_current_epoch", lambda group: view.epoch)
    monkeypatch.setattr(ed, "get_active_ranks", lambda group: view.active.to(torch.int64))
    monkeypatch.setattr(ed, "has_pending_change", lambda group: False)
    monkeypatch.setattr(ed, "add_change_listener", lambda group, fn: None)
    monkeypatch.setattr(ed, "get_pending_requests", lambda group: {})
    monkeypatch.setattr(ed, "get_slot_states", lambda group: [])
    monkeypatch.setattr(placement_sync, "share_placement", lambda ep, flag, group: None)
    monkeypatch.setattr(placement_sync, "reconcile", lambda ep, active, group, load: (
        placement_sync.ChangeReport(False, 0, 0, 0.0, 1)))

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        if t.numel() == 1 + 3 * G:  # the header: the peers have no work of their own
            zeros = torch.zeros(G, dtype=torch.int64)
            t += step_header(0, zeros, zeros, 1, 0)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    engine = ChangingEngine(me, change)
    placement = SimpleNamespace(max_ep_size=G, live_ranks=lambda: view.active.nonzero())
    engine.ep = SimpleNamespace(placement=placement, peer_weights=None,
                                step_max_tokens=None, uses_step_bound=True)
    loop = LockstepLoop(engine, engine.ep, FakeChannel(), object(), 0, True, None,
                        FaultInjector(0, []), RankContext(0), exchange=me,
                        exchange_store=store, exchange_deadline_s=30.0)
    with pytest.raises(ed.RankEvictedError):
        loop.run()
    first, redo = engine.tables[0], engine.tables[1]
    assert first[1] == row_of(me, ranks[1].arena) and first[2] == row_of(me, ranks[2].arena)
    # the redo ran on the relaunched rank 1's memory, with rank 2 unmapped
    assert redo[1] == row_of(me, relaunched.arena) and redo[2] == redo[0]
    assert engine.committed == [3]  # the kept batch, committed once, by the redo
    assert [n for n, _ in engine.executed] == [3]
    assert loop.stats.redos == 1 and loop.stats.recoveries == 1
    assert loop.stats.last_commit_epoch == 2  # committed in the new epoch
    assert me.active.tolist() == [1, 1, 0, 0] and me.peers[1][0] == 2
