"""Tear down old inner groups off the hot path.

Dropping the last reference to a ProcessGroupGloo joins its worker threads, which can
block until an abandoned op times out. Doing that on a caller thread would stall it
(the destructor runs with the GIL held), so old groups go to this thread, which keeps
them alive until their last work has finished (or errored) and only then drops them.

Interpreter exit waits for it (`_at_exit`): a daemon thread that drops a Gloo group
or work while the interpreter finalizes is killed as it takes the GIL back, through C++
frames that may not be unwound: std::terminate, SIGABRT. So a process that destroyed its
groups just before exiting died of it at random. At exit the reaper finishes the close
in progress and then closes nothing more (the OS frees what it still holds), and the
other daemon threads told to stop (`join_at_exit`) are waited for.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time

_q: queue.Queue = queue.Queue()
_started = threading.Lock()
_thread: threading.Thread | None = None
_MAX_HOLD_S = 600.0
_EXIT_WAIT_S = 5.0  # longest an exit waits for the threads below, in all (seconds)
_closing = threading.Lock()  # held while a close runs; `_exiting` is set under it
_exiting = False
_ending: list[threading.Thread] = []  # daemon threads told to stop (join_at_exit)
_exit_registered = False


def reap(inner) -> None:
    """Hand an `EpochGroups` (with `reapable()` and `close()`) to the reaper thread."""
    global _thread
    with _started:
        if _thread is None:
            _thread = threading.Thread(target=_loop, daemon=True, name="elastic-reaper")
            _thread.start()
            _register_exit()
    _q.put((time.monotonic(), inner))


def join_at_exit(threads) -> None:
    """Daemon threads just told to stop: interpreter exit waits for them to end (up to
    _EXIT_WAIT_S in all), so their last drops happen before finalization."""
    with _started:
        _ending[:] = [t for t in _ending if t.is_alive()] + list(threads)
        _register_exit()


def _register_exit() -> None:
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_at_exit)


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
                # destructors (and NCCL aborts) run here, never on a caller thread
                if not _close(inner):
                    threading.Event().wait()  # exiting: park, holding the rest, for good
            else:
                keep.append((t0, inner))
        held = keep


def _close(inner) -> bool:
    """Close `inner`, unless the interpreter is exiting (then False)."""
    with _closing:
        if _exiting:
            return False
        inner.close()
        return True


def _at_exit() -> None:
    """atexit: wait for the threads told to stop and for a close in progress (up to
    _EXIT_WAIT_S in all), then stop closing."""
    global _exiting
    deadline = time.monotonic() + _EXIT_WAIT_S
    for t in list(_ending):
        t.join(max(0.0, deadline - time.monotonic()))
    got = _closing.acquire(timeout=max(0.0, deadline - time.monotonic()))
    _exiting = True
    if got:
        _closing.release()
