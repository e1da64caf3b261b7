"""The host watchdog of a step that waits on its peers inside the GPU (the same-host
exchange, :mod:`elasticep.moe.exchange.ipc_exchange`).

A stream blocked on a peer that died or stopped never ends by itself, and the host
thread is blocked behind it (reading the sampled tokens). :class:`StepWatchdog` runs
beside it and ends the step's waits through :meth:`IpcExchange.abort` when the
coordinator announces a membership change, or when the step passes its deadline; the
step loop then redoes the step (its commit carries the abort vote).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from elasticep.moe.exchange.ipc_exchange import IpcExchange

logger = logging.getLogger(__name__)


@dataclass
class WatchedStep:
    """One step under a watchdog: ``aborted`` is True when its waits were released (the
    step must be redone); False until the watch ends, and for a step nobody watched."""

    aborted: bool = False


class StepWatchdog:
    """Releases an :class:`IpcExchange`'s waits when its step cannot finish.

    While a step runs (between :meth:`begin` and :meth:`end`) a daemon thread ends the
    step's waits through :meth:`IpcExchange.abort` once ``changed()`` is true (the
    coordinator announced a membership change) or the step is older than
    ``deadline_s``. The thread looks at ``changed()`` whenever :meth:`notify` is called
    (the group's change listener, on the control thread); :meth:`begin` looks at it on
    the caller's thread and wakes the watchdog only when a change is already pending.
    Otherwise the thread sleeps until the running step's deadline, or for
    ``deadline_s`` while none runs, so it wakes at most once a deadline and never at
    every step: a waking thread takes the GIL from the step loop (a 1 ms poller slowed
    a loop of small torch calls by 7 % on a 2-core host), and a wake at each step's
    start was served right after the step's device wait, on the step's host path.

    Args:
        exchange: the rank's exchange.
        changed: returns True once a membership change is pending (cheap, thread-safe).
        deadline_s: the longest a step may wait on peers before it is abandoned, seconds.
        poll_s: also wake this often, seconds, and look at ``changed()`` if a step runs
            (None: only on :meth:`notify` and :meth:`begin`; for a ``changed`` that
            nothing notifies about).

    Raises:
        ValueError: a ``deadline_s`` or ``poll_s`` that is not positive.
    """

    def __init__(self, exchange: IpcExchange, changed: Callable[[], bool], deadline_s: float,
                 poll_s: float | None = None) -> None:
        if deadline_s <= 0 or (poll_s is not None and poll_s <= 0):
            raise ValueError(f"the watchdog's deadline ({deadline_s} s) and poll interval "
                             f"({poll_s} s) must be positive")
        self.exchange, self.changed, self.deadline_s, self.poll_s = (
            exchange, changed, deadline_s, poll_s)
        self._started: float | None = None
        self._kicked = False
        self._aborting = False
        self._cv = threading.Condition()
        self.deadline_aborts = 0
        self._thread = threading.Thread(target=self._run, name="ipc-exchange-watchdog",
                                        daemon=True)
        self._thread.start()

    def begin(self) -> None:
        """A step starts (its exchanges may block from now on)."""
        with self._cv:
            self._started = time.monotonic()
        if self.changed():  # announced before this step: release it at once
            self.notify()

    @contextlib.contextmanager
    def watch(self) -> Iterator[WatchedStep]:
        """:meth:`begin` and :meth:`end` around the body, the step's device work; the
        yielded object's ``aborted`` is :meth:`end`'s answer once the body is left."""
        step = WatchedStep()
        self.begin()
        try:
            yield step
        finally:
            step.aborted = self.end()

    def end(self) -> bool:
        """The step's device work is done; True when it was aborted (redo it)."""
        with self._cv:
            self._started = None
            while self._aborting:  # an abort decided for this step lands before we look
                self._cv.wait()
        return self.exchange.aborted

    def notify(self) -> None:
        """A membership change may be pending: look at ``changed()`` now (any thread)."""
        with self._cv:
            self._kicked = True
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                started = self._started
                if started is None:
                    self._kicked = False  # nothing to release; the next begin() looks
                if not self._kicked:
                    # until the running step is due, or (none runs) until the latest
                    # moment one that begins now can be due: no wake per step
                    wait = (self.deadline_s if started is None
                            else started + self.deadline_s - time.monotonic())
                    if self.poll_s is not None:  # idle too: a step's begin() wakes nobody
                        wait = min(wait, self.poll_s)
                    if wait > 0:
                        self._cv.wait(wait)
                started, kicked = self._started, self._kicked
                self._kicked = False
            if started is None:
                continue
            due = time.monotonic() >= started + self.deadline_s
            if (kicked or self.poll_s is not None or due) and self._release(started, due):
                with self._cv:
                    if self._started is started and self.exchange.aborted:
                        self._started = None  # released: nothing more to do for this step

    def _release(self, started: float, due: bool) -> bool:
        # the step that began at ``started``: end its waits if a change is pending or
        # it is due; False when neither holds or the step ended meanwhile
        changed = self.changed()
        if not (changed or due):
            return False
        with self._cv:
            if self._started is not started:
                return False  # the step ended meanwhile: nothing to release
            self._aborting = True
        try:
            if changed:
                logger.info("membership change during a step: releasing its exchanges")
            else:
                logger.warning("step waited %.1f s on its peers' exchange rows: "
                               "abandoning it (a peer is stalled or dead)", self.deadline_s)
                self.deadline_aborts += 1
            self.exchange.abort()
        finally:
            with self._cv:
                self._aborting = False
                self._cv.notify_all()
        return True
