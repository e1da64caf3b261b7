"""One rank's :class:`LockstepLoop` without processes (not a test module).

The engine serves batches given up front, the channel carries nothing, and
``dist.all_reduce`` is replaced by "add a fixed peer's header", so a test can run
``loop.step()`` one step at a time. The fakes have what the loop reads of the real
engine and channel (:class:`~elasticep.engine.llm_engine.LLMEngine`,
:class:`~elasticep.frontend_link.WorkerChannel`), so the loop never asks what they have.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist

from elasticep.elastic.fault_injection import FaultInjector
from elasticep.elastic.log_context import RankContext
from elasticep.elastic.step_header import step_header
from elasticep.elastic.step_loop import LockstepLoop
from elasticep.elastic.step_profiler import StepProfiler
from elasticep.engine.scheduler import ScheduledBatch, ScheduledSeq


class FakeRunner:
    """The model runner's decode counters (:class:`~elasticep.engine.step_rate.DecodeCounters`)
    of an engine with no decode graphs and no decode step."""

    decode_replays = 0
    decode_eager = 0
    prefill_replays = 0
    graphs = None
    graph_captures = None


class FakeEngine:
    """``batches[i]`` lists the token counts of the i-th scheduled batch's sequences.

    ``execute`` records ``(batch tokens, ep.step_max_tokens)`` in ``executed`` and runs
    ``work`` (real torch ops, for a profiler to see) when given. ``events`` (shared with
    the :class:`FakeChannel`) logs each forward's launch and end, each commit and each
    send, in order.
    """

    def __init__(self, batches: list[list[int]], work: Callable[[], None] | None = None) -> None:
        self.queue = [ScheduledBatch(tuple(ScheduledSeq(None, 0, n) for n in b)) for b in batches]
        self.executed: list[tuple[int, int | None]] = []
        self.work = work
        self.ep = None
        self.runner = FakeRunner()
        self.events: list[tuple] = []

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def schedule(self) -> ScheduledBatch:
        return self.queue.pop(0) if self.queue else ScheduledBatch(())

    def execute(self, batch: ScheduledBatch, while_running=None) -> list[int]:
        self.executed.append((batch.num_tokens, self.ep.step_max_tokens))
        if self.work is not None:
            self.work()
        self.events.append(("launched", len(self.executed)))
        if while_running is not None:
            while_running()
        self.events.append(("done", len(self.executed)))
        return [0] * len(batch)

    def commit(self, batch: ScheduledBatch, tokens: list[int]) -> list:
        self.events.append(("commit", len(self.executed)))
        return [f"out{len(self.executed)}"]


class FakeChannel:
    epoch = 0

    def __init__(self, events: list | None = None) -> None:
        self.events = [] if events is None else events

    def poll(self, timeout: float) -> list:
        return []

    def send_outputs(self, outputs: list, epoch: int | None = None,
                     first_tokens: tuple = ()) -> None:
        self.events.append(("send", list(outputs), epoch))

    def send_stats(self, steps: int, graph_captures: int, graph_replays: int,
                   decode_replays: int = 0, decode_eager: int = 0,
                   experts_held: int = -1, prefill_replays: int = 0) -> None:
        self.stats = (steps, graph_captures, graph_replays, decode_replays, decode_eager,
                      prefill_replays)


def fake_loop(monkeypatch, rank: int, batches: list[list[int]], peer_tokens: int, *,
              work: Callable[[], None] | None = None,
              profiler: StepProfiler | None = None,
              defer_publish: bool | None = None
              ) -> tuple[LockstepLoop, FakeEngine, list[int]]:
    """Rank ``rank`` of 2 whose peer has ``peer_tokens`` scheduled at every step.

    Returns:
        The loop, its engine, and the element count of every all_reduce it makes.
    """
    M, peer = 2, 1 - rank
    calls: list[int] = []

    def fake_all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        calls.append(t.numel())
        if t.numel() == 1 + 3 * M:  # the header: add the peer's contribution
            zeros = torch.zeros(M, dtype=torch.int64)
            t += step_header(int(peer_tokens > 0), zeros, zeros, peer, peer_tokens)

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    engine = FakeEngine(batches, work)
    engine.ep = SimpleNamespace(placement=SimpleNamespace(max_ep_size=M), peer_weights=None,
                                step_max_tokens=None,
                                uses_step_bound=True)
    loop = LockstepLoop(engine, engine.ep, FakeChannel(engine.events), None, rank, False,
                        None, FaultInjector(rank, []), RankContext(rank), profiler=profiler,
                        defer_publish=defer_publish)
    return loop, engine, calls
