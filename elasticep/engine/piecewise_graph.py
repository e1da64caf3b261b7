"""Piecewise CUDA graph capture: graphs for the work between eager boundaries.

A decode forward of an EP rank exchanges tokens with its peers in every MoE layer. A
CUDA graph that held such a collective would hold the communicator too, and could not
be replayed once a peer died. So the forward is captured in pieces (the design vLLM
calls piecewise capture): code marks each point that must stay eager with
:func:`~elasticep.utils.graph_boundary.eager_boundary`, and :class:`PiecewiseCapture`
ends the current graph there, records the eager callable, and starts the next graph. :meth:`PiecewiseGraph.replay`
then alternates ``graph[i].replay()`` and ``op[i]()``.

The eager op is called with the same tensors at every replay, so it must read and write
only tensors whose storage outlives the capture (static buffers), and it must be safe to
run again with new contents in them. At capture time the op is not run: its
``at_capture`` stand-in is (for an exchange, a local copy), so a capture needs no peer
and each rank may capture on its own schedule.

Outside any capture, ``eager_boundary`` simply runs the op, so the same code serves
the eager path. Those primitives live in :mod:`elasticep.utils.graph_boundary`, below
the layers (``moe``) that call them; the capture itself is the engine's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from elasticep.utils import graph_boundary


class PiecewiseGraph:
    """Captured graphs with the eager ops between them (``len(ops) == len(graphs) - 1``).

    The graphs were captured in one memory pool in this order; replay in the same order
    keeps that pool's reuse of freed memory valid (torch's rule for shared pools).
    """

    def __init__(self, graphs: list[torch.cuda.CUDAGraph], ops: list[Callable[[], None]]) -> None:
        if len(ops) != len(graphs) - 1:
            raise ValueError(f"{len(graphs)} graphs need {len(graphs) - 1} eager ops, got {len(ops)}")
        self.graphs, self.ops = graphs, ops

    @property
    def num_pieces(self) -> int:
        return len(self.graphs)

    def replay(self, live_rows: int | None = None) -> None:
        """Replay every piece on the current stream, running the eager ops between.

        Args:
            live_rows: how many of the captured rows hold this step's tokens (the
                others pad the bucket); the eager ops read it through
                :func:`~elasticep.utils.graph_boundary.replay_rows`. None: unknown.
        """
        graph_boundary.set_replay_rows(live_rows)
        try:
            for i, graph in enumerate(self.graphs):
                graph.replay()
                if i < len(self.ops):
                    self.ops[i]()
        finally:
            graph_boundary.set_replay_rows(None)


class PiecewiseCapture:
    """Context manager that captures the enclosed CUDA work as a :class:`PiecewiseGraph`.

    With ``pool=None`` it captures nothing: eager boundaries inside run their
    ``at_capture`` stand-ins, which is what warm-up passes before a capture need (they
    compile kernels without talking to peers).

    Args:
        pool: a memory pool handle (``torch.cuda.graph_pool_handle()``) shared by every
            piece, or None for a warm-up pass.
        bound: a value the captured code reads through
            :func:`~elasticep.utils.graph_boundary.capture_bound` (the
            batch-size bucket), kept per thread so that a capture in a background thread
            never changes what the serving thread sees.
        variant: which of the executor's graph variants this capture records, read
            through :func:`~elasticep.utils.graph_boundary.capture_variant` (None:
            the plain forward).

    Must be entered on a side stream (as ``torch.cuda.graph`` does) and on one thread.
    Pieces are captured in ``thread_local`` error mode: other threads may keep running
    CUDA work (eager steps) on their own streams meanwhile.
    """

    def __init__(self, pool: tuple[int, int] | None = None, bound: int | None = None,
                 variant: str | None = None) -> None:
        self.pool = pool
        self.bound = bound
        self.variant = variant
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._ops: list[Callable[[], None]] = []
        self.result: PiecewiseGraph | None = None

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self._graphs.append(graph)

    def boundary(self, op: Callable[[], None], at_capture: Callable[[], None] | None) -> None:
        """An eager boundary inside this capture: end the current piece, run the
        stand-in, keep ``op`` for replay and begin the next piece (only the stand-in
        runs in a warm-up pass)."""
        if self.pool is not None:
            self._graphs[-1].capture_end()
        if at_capture is not None:
            at_capture()
        if self.pool is not None:
            self._ops.append(op)
            self._begin()

    def __enter__(self) -> PiecewiseCapture:
        graph_boundary.enter(self)  # raises if a capture is active (they do not nest)
        if self.pool is not None:
            self._begin()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        graph_boundary.leave()
        if self.pool is None:
            return
        if exc_type is not None:  # the capture is broken already; report the first error
            try:
                self._graphs[-1].capture_end()
            except RuntimeError:
                pass
            return
        self._graphs[-1].capture_end()
        self.result = PiecewiseGraph(self._graphs, self._ops)
