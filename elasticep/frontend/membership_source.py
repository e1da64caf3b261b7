"""Where the front-end learns the deployment's membership, and asks for a scale.

The serve glue adapts the coordinator client to :class:`MembershipSource`; the front-end
polls :meth:`MembershipSource.status` and routes only to ``healthy`` ranks.
:class:`ConnectedWorkers` is the stand-in for a deployment without a coordinator (one
engine worker, tests): every rank that said hello is healthy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from elasticep.frontend_link import WorkerHello
from elasticep.membership.errors import (
    ScaleInProgressError,
    ScaleNotSupportedError,
    ScaleRefusedError,
)
from elasticep.membership.status import DeploymentStatus, RankStatus
from elasticep.membership.transitions import SlotState

__all__ = ["ConnectedWorkers", "MembershipSource", "ScaleInProgressError",
           "ScaleNotSupportedError", "ScaleRefusedError"]


class MembershipSource(Protocol):
    """The membership as the coordinator sees it.

    ``status()`` returns the ``/elastic_ep_status`` shape as a
    :class:`~elasticep.membership.status.DeploymentStatus`; ``running_requests`` per
    rank is filled in by the front-end. Both methods may block briefly (they are called
    from a worker thread with a timeout).
    """

    def status(self) -> DeploymentStatus:
        """Current membership snapshot (see class doc)."""
        ...

    def scale(self, new_ep_size: int, operation_id: str | None = None,
              ) -> dict[str, Any] | None:
        """Start growing or shrinking to ``new_ep_size`` active ranks; returns at once.

        Args:
            operation_id: the operation's id; a repeat with it changes nothing.

        Raises:
            ScaleInProgressError: a change is already running.
            ScaleNotSupportedError: the deployment cannot scale.
            ValueError: ``new_ep_size`` is out of range or joiners are missing.
        """
        ...

    def retire(self, ranks: list[int] | None = None, node: int | None = None,
               operation_id: str | None = None, keep_processes: bool = False,
               ) -> dict[str, Any] | None:
        """Start retiring the slots ``ranks``, or every slot of ``node``; returns at once.
        With ``keep_processes`` their workers stay up, idle, once out of the group.

        Raises:
            ScaleInProgressError: a change is already running.
            ScaleRefusedError: too few healthy ranks would be left.
            ScaleNotSupportedError: the deployment cannot scale.
            ValueError: a slot is not in the target, or the node runs none.
        """
        ...

    def operation(self, operation_id: str) -> dict[str, Any]:
        """A scale or retire operation's phase and slot states.

        Raises:
            OperationNotFoundError: no operation has this id.
            ScaleNotSupportedError: the deployment cannot scale.
        """
        ...


class ConnectedWorkers:
    """Membership without a coordinator: every rank that said hello is healthy.

    Args:
        connected: returns rank -> latest hello (``FrontendChannel.connected``).
        ep_size: the expected number of ranks.
    """

    def __init__(self, connected: Callable[[], Mapping[int, WorkerHello]], ep_size: int = 1):
        self._connected = connected
        self._ep_size = ep_size

    def status(self) -> DeploymentStatus:
        hellos = dict(self._connected())
        ranks = tuple(RankStatus(r, SlotState.HEALTHY, h.pid, 0)
                      for r, h in sorted(hellos.items()))
        epoch = max((h.epoch for h in hellos.values()), default=0)
        return DeploymentStatus(epoch, self._ep_size, self._ep_size, ranks=ranks)

    def scale(self, new_ep_size: int, operation_id: str | None = None,
              ) -> dict[str, Any] | None:
        raise ScaleNotSupportedError("this deployment has no coordinator and cannot scale")

    def retire(self, ranks: list[int] | None = None, node: int | None = None,
               operation_id: str | None = None, keep_processes: bool = False,
               ) -> dict[str, Any] | None:
        raise ScaleNotSupportedError("this deployment has no coordinator and cannot retire "
                                     "ranks")

    def operation(self, operation_id: str) -> dict[str, Any]:
        raise ScaleNotSupportedError("this deployment has no coordinator and no operations")
