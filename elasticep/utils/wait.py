"""`wait_until`: the one bounded polling loop of the project.

Every wait on another process (a rank to become healthy, a port to answer, a status to
change) polls a predicate until it holds or a deadline passes, and then names what it
waited for. Waits inside the data plane (sliced collective waits) are not polls and stay
where they are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout_s: float, what: str, *, poll_s: float = 0.05,
               retry_on: tuple[type[BaseException], ...] = (),
               stop: threading.Event | None = None,
               last: Callable[[], object] | None = None) -> T | None:
    """Call ``pred()`` every ``poll_s`` seconds until it returns a truthy value.

    Args:
        pred: the condition; its truthy result is returned. An exception it raises ends
            the wait (use that for "the thing we wait on died"), unless listed in
            ``retry_on``.
        timeout_s: bound of the whole wait (seconds).
        what: what is awaited, for the error message ("rank 2 healthy").
        poll_s: interval between calls (seconds).
        retry_on: exceptions that mean "not yet" (e.g. a server still starting).
        stop: when set, the wait ends early and returns None.
        last: called at the timeout; its value is appended to the message (the last
            status seen, say).

    Returns:
        The first truthy value of ``pred()``; None if ``stop`` was set.

    Raises:
        TimeoutError: ``timeout_s`` passed; the message names ``what``.
    """
    deadline = time.monotonic() + timeout_s
    error: BaseException | None = None
    while True:
        try:
            value = pred()
            if value:
                return value
        except retry_on as exc:
            error = exc
        if time.monotonic() >= deadline:
            seen = "" if last is None else f"; last seen: {last()}"
            if error is not None and last is None:
                seen = f"; last error: {error!r}"
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}{seen}")
        if stop is not None:
            if stop.wait(poll_s):
                return None
        else:
            time.sleep(poll_s)
