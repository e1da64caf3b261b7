"""The step loop with a same-host exchange (no processes): a step whose exchange waits
were released by any rank's watchdog is redone, not committed, and the exchange is
reset before the next step; a clean step commits as before."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from elasticep.elastic.fault_injection import FaultInjector
from elasticep.elastic.log_context import RankContext
from elasticep.elastic.step_header import step_header
from elasticep.elastic.step_loop import LockstepLoop
from elasticep.moe.exchange.ipc_exchange import IpcExchange
from tests._loop_fakes import FakeChannel, FakeEngine


class CommitCountingEngine(FakeEngine):
    def __init__(self, batches):
        super().__init__(batches)
        self.committed = 0

    def commit(self, batch, tokens):
        self.committed += 1
        return []


def _loop(monkeypatch, peer_abort_at: set[int]):
    M, rank, peer = 2, 0, 1
    commits: list[list[int]] = []

    def fake_all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        if t.numel() == 1 + 3 * M:
            zeros = torch.zeros(M, dtype=torch.int64)
            t += step_header(1, zeros, zeros, peer, 1)
        elif t.numel() == 2:  # the commit: [step, aborted], MAX over the ranks
            step = int(t[0])
            t[1] = max(int(t[1]), int(step in peer_abort_at and len(commits) == step))
            commits.append(t.tolist())

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    engine = CommitCountingEngine([[1], [1], [1]])
    engine.ep = SimpleNamespace(placement=SimpleNamespace(max_ep_size=M), peer_weights=None,
                                step_max_tokens=None,
                                uses_step_bound=True)
    ex = IpcExchange(rank, M, 16, 8, torch.float32, 2, "cpu")
    loop = LockstepLoop(engine, engine.ep, FakeChannel(), None, rank, False, None,
                        FaultInjector(rank, []), RankContext(rank), exchange=ex,
                        exchange_deadline_s=30.0)
    return loop, engine, ex, commits


def test_a_peer_abort_vote_redoes_the_step_and_resets_the_exchange(monkeypatch):
    loop, engine, ex, commits = _loop(monkeypatch, peer_abort_at={1})
    loop.step()  # step 0: clean
    assert engine.committed == 1 and loop.stats.steps == 1
    ex.flags.fill_(1)  # what a released step leaves behind
    loop.step()  # step 1: the peer's watchdog released its waits
    assert commits[-1] == [1, 1]
    assert engine.committed == 1 and loop.stats.steps == 1 and loop.stats.redos == 1
    assert loop.pending is not None, "the batch is kept for the redo"
    assert int(ex.flags.sum()) == 0 and not ex.aborted
    loop.step()  # the redo of step 1 commits
    assert commits[-1] == [1, 0] and engine.committed == 2 and loop.stats.steps == 2
    assert [n for n, _ in engine.executed] == [1, 1, 1]


def test_this_ranks_own_abort_is_voted(monkeypatch):
    loop, engine, ex, commits = _loop(monkeypatch, peer_abort_at=set())
    real_execute = engine.execute

    def execute_and_abort(batch, while_running=None):
        ex.abort()  # the watchdog fired while this step ran
        return real_execute(batch, while_running)

    engine.execute = execute_and_abort
    loop.step()
    assert commits[-1] == [0, 1] and engine.committed == 0 and loop.stats.redos == 1
    assert not ex.aborted and ex.active.tolist() == [1, 1]
