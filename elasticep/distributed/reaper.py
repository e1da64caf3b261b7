"""Tear down old inner groups off the hot path.

Dropping the last reference to a ProcessGroupGloo joins its worker threads, which can
block until an abandoned op times out. Doing that on a caller thread would stall it
(the destructor runs with the GIL held), so old groups go to this thread, which keeps
them alive until their last work has finished (or errored) and only then drops them.
"""

from __future__ import annotations

import queue
import threading
import time

_q: queue.Queue = queue.Queue()
_started = threading.Lock()
_thread: threading.Thread | None = None
_MAX_HOLD_S = 600.0


def reap(inner) -> None:
    """Hand an `EpochGroups` (with `reapable()` and `close()`) to the reaper thread."""
    global _thread
    with _started:
        if _thread is None:
            _thread = threading.Thread(target=_loop, daemon=True, name="elastic-reaper")
            _thread.start()
    _q.put((time.monotonic(), inner))


def _loop() -> None:
    held: list = []
    while True:
        try:
            held.append(_q.get(timeout=0.5))
        except queue.Empty:
            pass
        now = time.monotonic()
        keep = []
        for t0, inner in held:
            if inner.reapable() or now - t0 > _MAX_HOLD_S:
                inner.close()  # destructors (and NCCL aborts) run here, never on a caller thread
            else:
                keep.append((t0, inner))
        held = keep
