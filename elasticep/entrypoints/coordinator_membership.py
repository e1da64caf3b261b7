"""The front-end's :class:`MembershipSource` backed by the coordinator.

The coordinator owns all membership: slot states, pids, epochs, the target size and the
scale phase (``distributed/scaling.py``). This adapter only keeps one connection to it
alive for the front-end's worker threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from elasticep.distributed import CoordinatorClient
from elasticep.distributed.status import DeploymentStatus

WORLD = "world"


class CoordinatorMembership:
    """:class:`MembershipSource` over a :class:`CoordinatorClient`.

    Thread-safe: the front-end calls ``status`` and ``scale`` from worker threads.

    Args:
        address: the coordinator's ``"host:port"``.
        timeout_s: bound of each coordinator call (seconds).
    """

    def __init__(self, address: str, timeout_s: float = 5.0) -> None:
        self._address = address
        self._timeout_s = timeout_s
        self._client: CoordinatorClient | None = None
        self._lock = threading.Lock()

    def _call(self, fn: Callable[[CoordinatorClient], Any]) -> Any:
        """Run ``fn`` on a (re)connected client; the connection is rebuilt after errors.

        Raises:
            ConnectionError / TimeoutError: the coordinator is unreachable.
            ValueError: the coordinator refused the request.
        """
        with self._lock:
            if self._client is None:
                self._client = CoordinatorClient(self._address, self._timeout_s)
            try:
                return fn(self._client)
            except (ConnectionError, TimeoutError, OSError):
                self._client.close()
                self._client = None
                raise

    def status(self) -> DeploymentStatus:
        """The ``/elastic_ep_status`` body (without ``running_requests``).

        Raises:
            ConnectionError / TimeoutError: the coordinator is unreachable.
        """
        return self._call(lambda c: c.deployment_status())

    def scale(self, new_ep_size: int) -> dict[str, Any]:
        """Make ``new_ep_size`` the target (see :meth:`CoordinatorClient.scale`).

        Raises:
            ScaleInProgressError: a scale is still running.
            ValueError: ``new_ep_size`` outside ``[1, max_ep_size]``.
            ConnectionError / TimeoutError: the coordinator is unreachable.
        """
        return self._call(lambda c: c.scale(new_ep_size))

    def close(self) -> None:
        """Close the coordinator connection."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
