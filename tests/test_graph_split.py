"""layer_boundary: where a captured decode forward may be split into graphs (CPU side;
the split graphs against eager are in tests/test_cuda_graph_gpu.py)."""

from __future__ import annotations

import pytest

from elasticep.engine.cuda_graph import layers_per_graph_default
from elasticep.utils.graph_pieces import PiecewiseCapture, layer_boundary


def test_layer_boundary_does_nothing_outside_a_capture_or_in_a_warm_up():
    layer_boundary(4)  # no capture: nothing to end
    with PiecewiseCapture(None, bound=1, layers_per_graph=2) as cap:  # warm-up: no graphs
        for i in range(6):
            layer_boundary(i)
    assert cap.result is None and cap._ops == []


def test_layers_per_graph_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("ELASTICEP_LAYERS_PER_GRAPH", raising=False)
    assert layers_per_graph_default() == 0
    monkeypatch.setenv("ELASTICEP_LAYERS_PER_GRAPH", "12")
    assert layers_per_graph_default() == 12
    monkeypatch.setenv("ELASTICEP_LAYERS_PER_GRAPH", "-1")
    with pytest.raises(ValueError, match="non-negative integer"):
        layers_per_graph_default()
