"""The host watchdog of a step that waits on its peers inside the GPU (the same-host
exchange, :mod:`elasticep.moe.ipc_exchange`).

A stream blocked on a peer that died or stopped never ends by itself, and the host
thread is blocked behind it (reading the sampled tokens). :class:`StepWatchdog` runs
beside it and ends the step's waits through :meth:`IpcExchange.abort` when the
coordinator announces a membership change, or when the step passes its deadline; the
step loop then redoes the step (its commit carries the abort vote).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from elasticep.moe.ipc_exchange import IpcExchange

logger = logging.getLogger(__name__)


class StepWatchdog:
    """Releases an :class:`IpcExchange`'s waits when its step cannot finish.

    While a step runs (between :meth:`begin` and :meth:`end`) a daemon thread ends the
    step's waits through :meth:`IpcExchange.abort` once ``changed()`` is true (the
    coordinator announced a membership change) or the step is older than
    ``deadline_s``. It looks at ``changed()`` when a step begins and whenever
    :meth:`notify` is called (the group's change listener, on the control thread), and
    otherwise sleeps until the deadline: a thread that woke every millisecond to poll
    took the GIL from the step loop about six times in a one-token step (a 1 ms poller
    slowed a loop of small torch calls by 7 % on a 2-core host).

    Args:
        exchange: the rank's exchange.
        changed: returns True once a membership change is pending (cheap, thread-safe).
        deadline_s: the longest a step may wait on peers before it is abandoned, seconds.
        poll_s: also look at ``changed()`` this often while a step runs, seconds (None:
            only on :meth:`notify`; for a ``changed`` that nothing notifies about).
    """

    def __init__(self, exchange: IpcExchange, changed: Callable[[], bool], deadline_s: float,
                 poll_s: float | None = None) -> None:
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
            self._cv.notify()

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
                while self._started is None:
                    self._cv.wait()
                started = self._started
                self._kicked = False
            self._watch(started)
            with self._cv:
                if self._started is started and self.exchange.aborted:
                    self._started = None  # released: nothing more to do for this step

    def _watch(self, started: float) -> None:
        # one step: returns when it ended, or after releasing its waits
        while True:
            changed = self.changed()
            left = started + self.deadline_s - time.monotonic()
            if changed or left <= 0:
                with self._cv:
                    if self._started is not started:
                        return  # the step ended meanwhile: nothing to release
                    self._aborting = True
                try:
                    if changed:
                        logger.info("membership change during a step: releasing its exchanges")
                    else:
                        logger.warning("step waited %.1f s on its peers' exchange rows: "
                                       "abandoning it (a peer is stalled or dead)",
                                       self.deadline_s)
                        self.deadline_aborts += 1
                    self.exchange.abort()
                finally:
                    with self._cv:
                        self._aborting = False
                        self._cv.notify_all()
                return
            with self._cv:
                if self._started is not started:
                    return
                if not self._kicked:
                    self._cv.wait(left if self.poll_s is None else min(left, self.poll_s))
                self._kicked = False
                if self._started is not started:
                    return
