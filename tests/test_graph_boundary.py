"""Eager boundaries (utils/graph_boundary) under the engine's piecewise capture, on CPU:
a warm-up pass (``pool=None``) captures nothing, so its semantics need no GPU."""

import threading

import pytest

from elasticep.engine.piecewise_graph import PiecewiseCapture
from elasticep.utils.graph_boundary import capture_bound, capturing, eager_boundary


def test_boundary_runs_the_op_outside_a_capture_and_the_stand_in_inside():
    ran = []
    eager_boundary(lambda: ran.append("op"), lambda: ran.append("stand-in"))
    assert ran == ["op"] and not capturing() and capture_bound() is None
    with PiecewiseCapture(pool=None, bound=8) as cap:
        assert capturing() and capture_bound() == 8
        eager_boundary(lambda: ran.append("op"), lambda: ran.append("stand-in"))
        eager_boundary(lambda: ran.append("op"))  # no stand-in: nothing runs
        seen = []  # the capture is per thread: another thread sees none
        t = threading.Thread(target=lambda: seen.append((capturing(), capture_bound())))
        t.start()
        t.join()
        assert seen == [(False, None)]
    assert ran == ["op", "stand-in"] and cap.result is None  # a warm-up keeps no graph
    assert not capturing() and capture_bound() is None


def test_captures_do_not_nest_and_an_error_leaves_none_active():
    with PiecewiseCapture(pool=None, bound=1):
        with pytest.raises(RuntimeError, match="do not nest"):
            PiecewiseCapture(pool=None).__enter__()
        assert capture_bound() == 1
    with pytest.raises(ValueError, match="boom"):
        with PiecewiseCapture(pool=None, bound=2):
            raise ValueError("boom")
    assert not capturing()
