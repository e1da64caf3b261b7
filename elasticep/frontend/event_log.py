"""``--event-log FILE``: every membership and recovery event as one JSON line.

The lines are :class:`~elasticep.frontend.recovery_timeline.Event` s, with the wall-clock
time added (``time``, Unix seconds) beside the monotonic ``t`` their durations use: the
timeline of a production incident, the same one ``/metrics`` observes, which
``python -m elasticep_testkit.plot_events`` draws.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import IO

from elasticep.frontend.recovery_timeline import Event

logger = logging.getLogger(__name__)


class EventLog:
    """Appends events to ``path`` (created if missing), one flushed line each.

    Args:
        path: the file.

    Raises:
        OSError: the file cannot be opened for appending.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()

    def write(self, event: Event) -> None:
        """Append one event (a write error is logged once and the log closed: the
        serving goes on without it)."""
        line = json.dumps({"time": round(time.time(), 6), **event.to_dict()})
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except OSError as exc:
                logger.error("--event-log %s: %s; no more events are written", self.path, exc)
                self._close()

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: str | Path) -> list[dict]:
    """The events of an event log, in order.

    Raises:
        OSError: unreadable file; ValueError: a line is not a JSON object.
    """
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: not a JSON object")
        out.append(obj)
    return out
