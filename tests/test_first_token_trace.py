"""The first-token trace: a rank's clock (elastic/first_token_clock.py) and the
front-end's stamps and summary (frontend/first_token_trace.py), with injected clocks."""

from __future__ import annotations

import itertools

import pytest

from elasticep import wire
from elasticep.elastic.first_token_clock import MAX_WAITING, FirstTokenClock
from elasticep.engine.request import AbortRequest, GenerateRequest, TokenOutput
from elasticep.frontend.first_token_trace import STAGES, FirstTokenTrace
from elasticep.frontend_link import FirstTokenTimes, OutputBatch
from elasticep.frontend_link.channels import _OUTPUTS, _decode

pytestmark = pytest.mark.timeout(30)


def ticking(start: int = 1000, step: int = 10):
    counter = itertools.count(start, step)
    return lambda: next(counter)


def test_rank_clock_times_the_first_token_only_and_counts_steps_from_receipt():
    clock = FirstTokenClock(ticking())
    clock.received([GenerateRequest("a", (1,)), GenerateRequest("b", (2,)),
                    AbortRequest("b")], steps=5)  # a: received at 1000; b aborted
    clock.step_started()  # 1010: a prefill chunk of a that samples nothing
    clock.scheduled(["a"])
    assert clock.committed([], steps=6) == ()
    clock.step_started()  # 1020
    clock.scheduled(["a"])  # its first step stays 1010
    [ft] = clock.committed([TokenOutput("a", 0, 7)], steps=7)  # committed at 1030
    assert ft == FirstTokenTimes("a", 1000, 1010, 1030, 2)
    assert clock.committed([TokenOutput("a", 1, 7)], steps=8) == ()  # later tokens: none
    # a loop that schedules inside its step (serve_loop) counts that step
    clock.received([GenerateRequest("c", (1,))], steps=8)  # 1040
    clock.step_started()  # 1050
    assert clock.committed([TokenOutput("c", 0, 1)], steps=9) == (
        FirstTokenTimes("c", 1040, 1050, 1060, 1),)


def test_rank_clock_forgets_the_oldest_past_its_bound():
    clock = FirstTokenClock(ticking())
    clock.received([GenerateRequest(f"r{i}", (1,)) for i in range(MAX_WAITING + 2)], 0)
    assert clock.committed([TokenOutput("r0", 0, 1)], 1) == ()  # dropped (never answered)
    assert len(clock.committed([TokenOutput(f"r{MAX_WAITING + 1}", 0, 1)], 1)) == 1


def test_first_token_times_ride_the_output_batch_as_rows():
    batch = OutputBatch(0, 3, (TokenOutput("a", 0, 7),),
                        (FirstTokenTimes("a", 1, 2, 3, 1),), sent_us=4)
    assert _decode(wire.encode_json(batch), _OUTPUTS, "test") == batch


def test_front_end_trace_gives_every_stage_and_percentiles():
    now = [0]
    trace = FirstTokenTrace(lambda: now[0])
    for i in range(4):
        rid = f"r{i}"
        trace.arrived(rid, 100, 300)  # handler start, tokenized
        now[0] = 400
        trace.routed(rid)
        now[0] = 2_000 + 1_000 * i  # the batch reaches the front-end
        [got] = [trace.rank_batch([FirstTokenTimes(rid, 500, 600, 1_600, 1 + i % 2)], 1_700)]
        assert got == [rid]
        now[0] += 100
        trace.delivered([rid])
        now[0] += 50
        trace.written(rid)
    trace.arrived("gone", None, None)  # never got a token: left out
    trace.closed("gone")
    s = trace.summary(reset=True)
    assert s["requests"] == 4
    st = s["stages_ms"]
    assert list(st) == list(STAGES)
    assert st["http_to_tokenized"] == {"p50": 0.2, "p99": 0.2, "mean": 0.2}
    assert st["routed_to_rank"]["p50"] == 0.1
    assert st["rank_to_scheduled"]["p50"] == 0.1
    assert st["scheduled_to_committed"]["p50"] == 1.0
    assert st["committed_to_published"]["p50"] == 0.1
    # published at 1.7 ms, reached the front-end at 2, 3, 4, 5 ms
    assert st["published_to_frontend"] == {"p50": 1.3, "p99": 3.3, "mean": 1.8}
    assert st["delivered_to_written"]["p99"] == 0.05
    # the front-end's own stages: 0.2 + 0.1 + 0.1 + 0.05
    assert s["frontend_ms"]["p50"] == 0.45
    # handler start (0.1 ms) to the SSE write (2.15, 3.15, 4.15, 5.15 ms)
    assert s["total_ms"] == {"p50": 3.05, "p99": 5.05, "mean": 3.55}
    assert s["rank_steps"] == {"p50": 1, "p99": 2, "max": 2}
    assert trace.summary()["requests"] == 0  # reset
