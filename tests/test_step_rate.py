"""The periodic throughput line of a rank (elasticep.engine.step_rate)."""

from __future__ import annotations

from types import SimpleNamespace

from elasticep.engine.step_rate import StepRateLog


def test_logs_rates_once_per_interval_with_graph_replays():
    now = [100.0]
    # replays and captures before the log existed are not this interval's
    graphs = SimpleNamespace(replays=7, captures=1)
    log = StepRateLog(3, graphs, interval_s=10.0, clock=lambda: now[0])
    for _ in range(4):  # 4 steps of 8 tokens over 8 s: no line yet
        now[0] += 2.0
        graphs.replays += 1
        assert log.step(8, epoch=2) is None
    graphs.captures += 1  # a re-capture in this interval
    now[0] += 2.0  # the 5th step closes the interval: 5 steps, 40 tokens, 10 s
    line = log.step(8, epoch=2)
    assert line == ("rank 3 epoch 2: 5 steps in 10.0 s (2000.00 ms/step), 4.0 generated "
                    "tokens/s, 8.0 tokens/step; decode CUDA graph replays: 4 of 5 steps; "
                    "graph captures: 2 since start (+1)")
    now[0] += 1.0  # counters restart with the next interval
    assert log.step(2, epoch=3) is None
    now[0] += 9.5
    line = log.step(0, epoch=3)
    assert line.startswith("rank 3 epoch 3: 2 steps in 10.5 s (5250.00 ms/step)")
    assert line.endswith("graph captures: 2 since start (+0)")


def test_an_engine_without_graphs_gets_no_graph_part():
    now = [0.0]
    log = StepRateLog(1, None, interval_s=1.0, clock=lambda: now[0])
    now[0] += 2.0
    assert log.step(4, epoch=0) == ("rank 1 epoch 0: 1 steps in 2.0 s (2000.00 ms/step), "
                                     "2.0 generated tokens/s, 4.0 tokens/step")


def test_disabled_with_a_non_positive_interval():
    now = [0.0]
    log = StepRateLog(0, SimpleNamespace(replays=0, captures=0), interval_s=0,
                      clock=lambda: now[0])
    now[0] += 1e6
    assert log.step(5, epoch=0) is None
