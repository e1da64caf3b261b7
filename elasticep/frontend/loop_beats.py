"""The liveness of an extra front-end process's event loop (``serve
--api-server-count``): the process's loop beats on a counter in shared memory
(:func:`beat`), and the pool that watches it (:mod:`.api_server_pool`) decides from the
counter alone whether the loop has stalled (:func:`stall_check`).

The beat is a callback of the loop itself, not a thread of the process: a process that
is stopped by a signal, or whose loop is stuck in a call that never returns, stops
beating, though it is alive and its other threads may run. A counter read with the
watcher's own clock, rather than a timestamp written by the process, needs no clock
shared between the processes, and a watcher that was itself held up sees a moved
counter when it looks again instead of a silence that was its own.
"""

from __future__ import annotations

import asyncio
import ctypes
from dataclasses import dataclass

# How often a serving process's loop beats (seconds).
BEAT_S = 0.5
# How long a serving process's loop may go without a beat before the process counts as
# stalled (seconds). The longest holds of a healthy front-end loop are a collection of
# its whole heap (under a fifth of a second even before its start-up heap is frozen:
# docs/results/cpu-i50t) and a burst of admissions, short callbacks between which the
# beat gets its turn; on a loaded two-core machine a runnable process may also wait a
# second or more for a core. Twenty missed beats is far beyond all of these, and short
# against the clients of a stalled process, who would otherwise wait for ever.
STALL_TIMEOUT_S = 10.0


def beat(beats: ctypes.c_uint64, every_s: float = BEAT_S) -> None:
    """Add one to ``beats`` now and every ``every_s`` seconds after, as callbacks of the
    running event loop (call it on the loop, e.g. through ``call_soon_threadsafe``)."""
    beats.value += 1
    asyncio.get_running_loop().call_later(every_s, beat, beats, every_s)


@dataclass(frozen=True)
class BeatsSeen:
    """What the watcher last saw of one process's beat counter.

    Attributes:
        count: the counter's value (0: no beat yet, the process does not serve yet).
        since: when the watcher first saw that value (seconds of a monotonic clock).
    """

    count: int = 0
    since: float = 0.0


def stall_check(seen: BeatsSeen, count: int, now: float, stopping: bool,
                timeout_s: float = STALL_TIMEOUT_S) -> tuple[BeatsSeen, float | None]:
    """Look at one process's beat counter (pure).

    Args:
        seen: the last look (a new process's: count 0, since its spawn).
        count: the counter now.
        now: the time now, same clock as ``seen.since``.
        stopping: the pool is stopping (no process counts as stalled then).
        timeout_s: the longest silence of a serving process's loop (seconds).

    Returns:
        This look, and how long the loop has been silent (seconds) when the process is
        stalled: it has beaten at least once (it serves), the pool is not stopping,
        and the counter has stayed for longer than ``timeout_s``; else None.
    """
    if count != seen.count:
        return BeatsSeen(count, now), None
    silent = now - seen.since
    if count == 0 or stopping or silent <= timeout_s:
        return seen, None
    return seen, silent
