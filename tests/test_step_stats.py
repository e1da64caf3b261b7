"""Where a lockstep step's time goes (elasticep.elastic.step_stats), alone and as the
step loop reports it."""

import pytest
from _loop_fakes import fake_loop

from elasticep.elastic.step_stats import PHASES, StepTimers


def test_each_phase_lasts_until_the_next_one_starts():
    now = [10.0]
    timers = StepTimers(clock=lambda: now[0])
    for phase, at in zip(PHASES, (10.0, 10.5, 12.0, 12.25), strict=True):
        now[0] = at
        timers.enter(phase)
    now[0] = 13.0
    assert timers.durations() == {"header": 0.5, "execute": 1.5, "commit": 0.25,
                                  "publish": 0.75}


def test_a_step_that_ends_early_reports_the_phases_it_entered():
    now = [0.0]
    timers = StepTimers(clock=lambda: now[0])
    timers.enter("header")
    now[0] = 2.0
    assert timers.durations() == {"header": 2.0}
    with pytest.raises(ValueError, match="unknown step phase"):
        timers.enter("forward")


def test_the_loop_times_every_phase_of_a_committed_step(monkeypatch):
    loop, engine, _ = fake_loop(monkeypatch, 0, [[2]], peer_tokens=1)
    timed: list[tuple[str, float]] = []
    monkeypatch.setattr(loop.rate, "timed", lambda part, s: timed.append((part, s)))
    loop.step()
    assert loop.stats.steps == 1
    assert [p for p, _ in timed] == list(PHASES) and all(s >= 0 for _, s in timed)
