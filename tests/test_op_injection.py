"""The fault injector of a group's collectives (elasticep.distributed.op_injection)."""

import time

from elasticep.distributed.op_injection import NO_FAULTS, FinishLate, OpInjector


def test_finish_late_delays_one_op_only():
    late: OpInjector = FinishLate(0.2)
    t0 = time.monotonic()
    late.before_complete(7)
    first = time.monotonic() - t0
    t0 = time.monotonic()
    late.before_complete(8)
    second = time.monotonic() - t0
    assert first >= 0.2 and second < 0.05


def test_the_default_injector_does_nothing():
    t0 = time.monotonic()
    assert NO_FAULTS.before_complete(0) is None
    assert time.monotonic() - t0 < 0.05
