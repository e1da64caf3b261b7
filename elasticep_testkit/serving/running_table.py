"""The request table that every scripted rank engine of the test kit shares."""

from __future__ import annotations

from typing import Any


class RunningTable:
    """The :class:`~elasticep.elastic.serve_loop.StepEngine` calls that only read or drop
    requests, over ``running``: request id -> the engine's own state of that request, in
    arrival order. A subclass fills ``running`` in ``add_request`` and empties it in
    ``step``."""

    running: dict[str, Any]

    def abort(self, request_id: str) -> bool:
        """Drop a request; True if it was running."""
        return self.running.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        """True while any request runs."""
        return bool(self.running)

    def request_ids(self) -> list[str]:
        """Ids of the running requests, in arrival order."""
        return list(self.running)
