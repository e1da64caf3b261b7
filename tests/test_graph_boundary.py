"""Eager boundaries (utils/graph_boundary) under the engine's piecewise capture, on CPU:
a warm-up pass (``pool=None``) captures nothing, so its semantics need no GPU; a replay's
eager ops run on stand-in graphs."""

import threading

import pytest
import torch

from elasticep.elastic.rank_model import HookedExecutor
from elasticep.engine.piecewise_graph import PiecewiseCapture, PiecewiseGraph
from elasticep.eplb import EPLBConfig, EPLBManager
from elasticep.utils import graph_boundary
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


class _KeepOps:
    """A capture (graph_boundary.Capture) that keeps each eager op, as a real one does."""

    bound = variant = None

    def __init__(self) -> None:
        self.ops: list = []

    def boundary(self, op, at_capture) -> None:
        self.ops.append(op)


class _NoGraph:
    def replay(self) -> None:
        pass


def test_eplb_counts_a_replays_step_rows_not_the_bucket_padding():
    eplb = EPLBManager(num_layers=2, num_logical_experts=4, config=EPLBConfig(window_size=4))
    hooked = HookedExecutor(lambda layer, x, ids, w: x, hooks=[eplb.record])
    # captured at a bucket of 8 rows: the hook holds the static topk_ids buffer
    topk_ids = torch.zeros(8, 2, dtype=torch.long)
    cap = _KeepOps()
    graph_boundary.enter(cap)
    try:
        for layer in range(2):
            hooked(layer, torch.zeros(8, 1), topk_ids, torch.ones(8, 2))
    finally:
        graph_boundary.leave()
    graph = PiecewiseGraph([_NoGraph()] * (len(cap.ops) + 1), cap.ops)
    # a step of 3 tokens: rows 0-2 route to experts 1 and 2, the 5 padding rows to 3
    topk_ids[:3] = torch.tensor([1, 2])
    topk_ids[3:] = 3
    graph.replay(live_rows=3)
    eplb.step()
    assert eplb.window_counts().tolist() == [[0, 3, 3, 0], [0, 3, 3, 0]]
    assert graph_boundary.replay_rows() is None  # only while the replay runs
    graph.replay(live_rows=0)  # an idle EP rank's replay: its rows are all padding
    eplb.step()
    assert eplb.window_counts().tolist() == [[0, 3, 3, 0], [0, 3, 3, 0]]
    # eagerly (no replay) a hook sees every row it is given
    hooked(0, torch.zeros(2, 1), torch.tensor([[0, 3], [0, 3]]), torch.ones(2, 2))
    eplb.step()
    assert eplb.window_counts()[0].tolist() == [2, 3, 3, 2]
