"""Where a deployment's membership comes from: the one place the ``elastic`` and
``none`` backends differ for everything above the workers.

* ``elastic``: the coordinator owns all membership (slot states, pids, epochs, the
  target size and the scale phase, ``membership/scaling.py``);
  :class:`CoordinatorMembership` keeps one connection to it for the front-end's threads.
* ``none``: :class:`LaunchedRanks`, from the launcher's own processes.

Both give the front-end's ``MembershipSource``: ``status()`` and ``scale()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from elasticep.deploy.launcher import RankLauncher
from elasticep.frontend_link import WorkerHello, is_routable
from elasticep.membership.client import CoordinatorClient, ReconnectingClient
from elasticep.membership.errors import ScaleNotSupportedError
from elasticep.membership.status import DeploymentStatus, RankStatus
from elasticep.membership.transitions import SlotState


class CoordinatorMembership:
    """:class:`MembershipSource` over a :class:`CoordinatorClient`.

    Thread-safe: the front-end calls ``status`` and ``scale`` from worker threads.

    Args:
        address: the coordinator's ``"host:port"``.
        timeout_s: bound of each coordinator call (seconds).
        find_leader: with standby coordinators, returns the elected one's address
            (``launcher.leader_finder``): the client follows a leader change.
    """

    def __init__(self, address: str, timeout_s: float = 5.0,
                 find_leader: Callable[[], str] | None = None) -> None:
        self._client = ReconnectingClient(address, timeout_s, find_leader=find_leader)

    def status(self) -> DeploymentStatus:
        """The ``/elastic_ep_status`` body (without ``running_requests``).

        Raises:
            ConnectionError / TimeoutError: the coordinator is unreachable.
        """
        return self._client.call(CoordinatorClient.deployment_status)

    def scale(self, new_ep_size: int, operation_id: str | None = None) -> dict[str, Any]:
        """Make ``new_ep_size`` the target (see :meth:`CoordinatorClient.scale`).

        Raises:
            ScaleInProgressError: a scale is still running.
            ValueError: ``new_ep_size`` outside ``[1, max_ep_size]``.
            ConnectionError / TimeoutError: the coordinator is unreachable.
        """
        return self._client.call(lambda c: c.scale(new_ep_size, operation_id))

    def retire(self, ranks: list[int] | None = None, node: int | None = None,
               operation_id: str | None = None, keep_processes: bool = False,
               ) -> dict[str, Any]:
        """Retire chosen slots or a node's (see :meth:`CoordinatorClient.retire`)."""
        return self._client.call(lambda c: c.retire(ranks, node, operation_id,
                                                    keep_processes))

    def operation(self, operation_id: str) -> dict[str, Any]:
        """An operation's phase and slot states (:meth:`CoordinatorClient.operation`)."""
        return self._client.call(lambda c: c.operation(operation_id))

    def close(self) -> None:
        """Close the coordinator connection."""
        self._client.close()


class LaunchedRanks:
    """Membership of ``--elastic-ep-backend none``: its ranks never register with the
    coordinator, so what this node's launcher knows (the pids it started, whether they
    still run) and, in serve, which workers said hello to the front-end, make the status.

    Every rank is ``failed`` once one of them exited: plain torch.distributed groups
    cannot make progress without a member. It cannot scale.

    Args:
        launcher: the launcher of the deployment's ranks.
        ep_size: the number of ranks.
        connected: rank -> latest hello (``FrontendChannel.connected``); a rank is healthy
            only once its worker said hello. None: every running rank is healthy.
    """

    def __init__(self, launcher: RankLauncher, ep_size: int,
                 connected: Callable[[], Mapping[int, WorkerHello]] | None = None) -> None:
        self._launcher = launcher
        self._ep_size = ep_size
        self._connected = connected

    def status(self) -> DeploymentStatus:
        """The ``/elastic_ep_status`` view of the launched ranks (see the class)."""
        launched = self._launcher.pids(live_only=False)
        hellos = {} if self._connected is None else dict(self._connected())
        broken = any(self._launcher.exited(r) for r in launched)
        ranks = []
        for r in sorted(set(launched) | set(hellos)):  # another node's ranks only say hello
            pid = launched[r] if r in launched else hellos[r].pid
            said_hello = (self._connected is None
                          or is_routable(SlotState.HEALTHY, pid, hellos.get(r)))
            state = (SlotState.FAILED if broken else
                     SlotState.HEALTHY if said_hello else SlotState.JOINING)
            ranks.append(RankStatus(r, state, pid))
        epoch = max((h.epoch for h in hellos.values()), default=0)
        return DeploymentStatus(epoch, self._ep_size, self._ep_size, ranks=tuple(ranks))

    def scale(self, new_ep_size: int, operation_id: str | None = None) -> dict[str, Any]:
        """Raises:
            ScaleNotSupportedError: always (HTTP 400).
        """
        raise ScaleNotSupportedError("--elastic-ep-backend none has no coordinator-managed "
                                     "membership and cannot scale")

    def retire(self, ranks: list[int] | None = None, node: int | None = None,
               operation_id: str | None = None, keep_processes: bool = False,
               ) -> dict[str, Any]:
        """Raises:
            ScaleNotSupportedError: always (HTTP 400).
        """
        return self.scale(0)

    def operation(self, operation_id: str) -> dict[str, Any]:
        """Raises:
            ScaleNotSupportedError: always (HTTP 400).
        """
        return self.scale(0)
