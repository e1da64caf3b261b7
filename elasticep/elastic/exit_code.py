"""The exit statuses of a worker rank: what the supervisor of its process reads."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """How a worker process ended (its exit status).

    A status that is none of these is a crash: a signal (negative, from ``Popen``) or
    Python's own status of an uncaught error.
    """

    REMOVED = 0  # a planned removal (scale-down): a clean exit, its slot is free again
    ERROR = 1  # the worker failed (logged with its traceback)
    LOST = 3  # evicted, or the coordinator was lost: its slot is failed
