"""The periodic throughput line of a rank (elasticep.engine.step_rate)."""

from __future__ import annotations

from types import SimpleNamespace

from elasticep.engine.step_rate import StepRateLog


def test_logs_rates_once_per_interval_with_graph_replays():
    now = [100.0]
    # replays and captures before the log existed are not this interval's
    counts = SimpleNamespace(decode_replays=7, decode_eager=2, prefill_replays=5,
                             graph_captures=1)
    log = StepRateLog(3, counts, interval_s=10.0, clock=lambda: now[0])
    for _ in range(4):  # 4 decode steps of 8 tokens over 8 s: no line yet
        now[0] += 2.0
        counts.decode_replays += 1
        assert log.step(8, epoch=2) is None
    counts.graph_captures += 1  # a re-capture in this interval
    counts.decode_eager += 1  # the 5th step decoded eagerly (during the capture)
    counts.prefill_replays += 3  # three prefill steps replayed as rows
    now[0] += 2.0  # the 5th step closes the interval: 5 steps, 40 tokens, 10 s
    line = log.step(8, epoch=2)
    assert line == ("rank 3 epoch 2: 5 steps in 10.0 s (2000.00 ms/step), 4.0 generated "
                    "tokens/s, 8.0 tokens/step; decode CUDA graph replays: 4 of 5 decode "
                    "steps (1 eager); prefill steps replayed as rows: 3; graph captures: 2 "
                    "since start (+1)")
    now[0] += 1.0  # counters restart with the next interval; a prefill step counts in
    assert log.step(2, epoch=3) is None  # steps, in neither decode count
    now[0] += 9.5
    line = log.step(0, epoch=3)
    assert line.startswith("rank 3 epoch 3: 2 steps in 10.5 s (5250.00 ms/step)")
    assert line.endswith("decode CUDA graph replays: 0 of 0 decode steps (0 eager); "
                         "prefill steps replayed as rows: 0; graph captures: 2 since start "
                         "(+0)")


def test_a_runner_without_graphs_counts_its_eager_decode_steps():
    now = [0.0]
    counts = SimpleNamespace(decode_replays=0, decode_eager=0, prefill_replays=0,
                             graph_captures=None)
    log = StepRateLog(1, counts, interval_s=1.0, clock=lambda: now[0])
    now[0] += 2.0
    counts.decode_eager += 1
    assert log.step(4, epoch=0) == ("rank 1 epoch 0: 1 steps in 2.0 s (2000.00 ms/step), "
                                     "2.0 generated tokens/s, 4.0 tokens/step; decode CUDA "
                                     "graph replays: 0 of 1 decode steps (1 eager); "
                                     "prefill steps replayed as rows: 0; no CUDA graphs")


def test_an_engine_without_counters_gets_no_decode_part():
    now = [0.0]
    log = StepRateLog(1, None, interval_s=1.0, clock=lambda: now[0])
    now[0] += 2.0
    assert log.step(4, epoch=0) == ("rank 1 epoch 0: 1 steps in 2.0 s (2000.00 ms/step), "
                                     "2.0 generated tokens/s, 4.0 tokens/step")


def test_disabled_with_a_non_positive_interval():
    now = [0.0]
    log = StepRateLog(0, SimpleNamespace(decode_replays=0, decode_eager=0, prefill_replays=0,
                                             graph_captures=0),
                      interval_s=0, clock=lambda: now[0])
    now[0] += 1e6
    assert log.step(5, epoch=0) is None
