"""Where a CUDA graph capture must break: eager boundaries, and what the code being
captured may ask of the capture.

Code that runs inside a captured forward (an EP executor's token exchange, say) marks
each point that must stay out of any graph with :func:`eager_boundary`. Outside a
capture the op simply runs; inside one, the thread's active capture (the engine's
:class:`~elasticep.engine.piecewise_graph.PiecewiseCapture`, which makes itself the
active one with :func:`enter` and :func:`leave`) ends its current graph there, records the op for replay, and runs the
``at_capture`` stand-in instead. The capture itself lives in ``engine/``; this module
holds only what the layers below it (``moe``) call, so they need not import the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

_state = threading.local()


class Capture(Protocol):
    """What an active capture offers the code it captures."""

    bound: int | None  # see capture_bound
    variant: str | None  # see capture_variant

    def boundary(self, op: Callable[[], None], at_capture: Callable[[], None] | None) -> None:
        """End the current graph before ``op`` (kept for replay), run ``at_capture``,
        and start the next graph."""


def enter(capture: Capture) -> None:
    """Make ``capture`` this thread's active capture (until :func:`leave`).

    Raises:
        RuntimeError: a capture is already active on this thread (captures do not nest).
    """
    if getattr(_state, "capture", None) is not None:
        raise RuntimeError("piecewise captures do not nest")
    _state.capture = capture


def leave() -> None:
    """This thread has no active capture any more."""
    _state.capture = None


def eager_boundary(op: Callable[[], None], at_capture: Callable[[], None] | None = None) -> None:
    """Run ``op`` outside any CUDA graph.

    Args:
        op: the eager work (e.g. a collective over static buffers).
        at_capture: what to run instead while a capture is active (None: nothing). Its
            results feed the rest of the capture only as placeholder values.
    """
    capture: Capture | None = getattr(_state, "capture", None)
    if capture is None:
        op()
    else:
        capture.boundary(op, at_capture)


def capturing() -> bool:
    """True inside a capture (warm-up or graph capture) on this thread."""
    return getattr(_state, "capture", None) is not None


def capture_bound() -> int | None:
    """The ``bound`` of this thread's active capture (for an EP executor: the tokens
    its exchange is sized for), or None."""
    capture = getattr(_state, "capture", None)
    return None if capture is None else capture.bound


def capture_variant() -> str | None:
    """The graph variant this thread's active capture records (None outside a capture,
    and for the plain one). An executor may offer several forms of one forward (see
    ``graph_variants`` in :mod:`elasticep.moe.executor`); the code being captured reads
    this to know which form it is recording."""
    capture = getattr(_state, "capture", None)
    return None if capture is None else capture.variant


def replay_rows() -> int | None:
    """The rows of the graph being replayed on this thread that hold the step's tokens
    (a replay pads its batch up to the bucket's rows; the rest are padding), or None
    outside a replay (an eager forward's tensors hold its tokens only).

    An eager op that reads a per-token tensor for what it says about the step (EPLB's
    routed-token counts) keeps its first ``replay_rows()`` rows; the padding rows route
    too, to whatever experts their dummy inputs pick.
    """
    return getattr(_state, "replay_rows", None)


def set_replay_rows(rows: int | None) -> None:
    """Set what :func:`replay_rows` returns on this thread (None: no replay running)."""
    _state.replay_rows = rows
