"""A node's planned stop while other nodes serve on (``--membership-store etcd://``).

When one node's ``serve`` is stopped on purpose (Ctrl-C, SIGTERM) and another node's
coordinator replica leads, the leader would see that node's ranks exit and fail them:
a failure epoch, ``failed`` slots, warnings, as if the node had crashed. The node
instead retires the slots of its live ranks first, as a planned scale-down does
(``CoordinatorClient.retire``): its ranks drain (their requests and experts
move to the other nodes' ranks), leave at a step boundary and exit 0, the leader logs
each as "left after its planned removal", and the slots become free (retired), so no
launcher relaunches them. Run again with the same flags, the node takes them back in
recover mode (``serve_node.rejoin_ranks``).

The leader refuses a retirement that would leave no healthy rank, or too few to hold
every expert (the last node of a deployment being stopped, say), or one that races a
scale in flight: the node then stops as before, as it does when the other nodes stop
too while it waits (every node told to stop at once) or the leader stops answering.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from elasticep.deploy.deployment import Deployment
from elasticep.membership.transitions import SlotState

logger = logging.getLogger("elasticep.deploy.supervisor")

LEAVE_TIMEOUT_S = 10.0  # the longest a planned stop waits for its ranks to leave, seconds
_POLL_S = 0.05
_LOOK_S = 0.5  # how often the deployment's status is asked while waiting, seconds


def leave_on_purpose(deployment: Deployment, timeout_s: float = LEAVE_TIMEOUT_S) -> bool:
    """Retire the slots of the live ranks ``deployment`` started, through the leader,
    and wait up to ``timeout_s`` seconds for every worker started here to exit (see
    the module docstring). Call before :meth:`Deployment.stop`, which kills what is
    left.

    Returns:
        True when no worker started here is left running; False when the leader
        refused or could not be asked (the reason is logged), or time ran out.
    """
    ranks = sorted(deployment.pids(live_only=True))
    if not ranks:
        return True
    node = deployment.node
    joining = _joining(deployment, ranks)
    if joining:
        # a retirement races their admission: admitted after it began, they would be
        # stopped as failures with the deployment shrunk under them
        logger.info("node %d: stopping without retiring its slots first: ranks %s are "
                    "still joining", node, joining)
        return False
    op, why = _ask_retirement(deployment, ranks)
    if op is None:
        logger.info("node %d: stopping without retiring its slots first: %s", node, why)
        return False
    logger.info("node %d: a planned stop: retiring slots %s (operation %s) before its "
                "ranks stop", node, op.get("slots"), op.get("operation_id"))
    deadline = time.monotonic() + timeout_s
    next_look = time.monotonic() + _LOOK_S
    while deployment.pids(live_only=True):
        if time.monotonic() >= deadline:
            logger.warning("node %d: ranks %s still running %.0f s after their retirement "
                           "began; stopping them", node,
                           sorted(deployment.pids(live_only=True)), timeout_s)
            return False
        if time.monotonic() >= next_look:
            why = _cannot_finish(deployment, ranks)
            if why:
                logger.info("node %d: stopping before its ranks left: %s", node, why)
                return False
            next_look = time.monotonic() + _LOOK_S
        time.sleep(_POLL_S)
    logger.info("node %d: its ranks left after their planned removal", node)
    return True


def _ask_retirement(deployment: Deployment,
                    ranks: list[int]) -> tuple[dict[str, Any] | None, str]:
    """Ask the leader to retire ``ranks`` (named by rank: a leader that took over may not
    know every rank's node yet); (its answer, "") or (None, why not)."""
    # one id for both tries: a repeat of a retirement that did reach the leader is
    # answered again, not refused
    op_id = f"stop-node{deployment.node}-{os.getpid()}"
    why = ""
    for _ in range(2):
        try:
            return deployment.launcher.call(
                lambda c: c.retire(ranks=ranks, operation_id=op_id)), ""
        except ValueError as exc:  # refused
            return None, str(exc)
        except (ConnectionError, TimeoutError, OSError) as exc:
            # a connection to a leader that has gone fails once; the next call finds
            # the new leader
            why = str(exc)
    return None, why


def _joining(deployment: Deployment, ranks: list[int]) -> list[int]:
    """Those of ``ranks`` the coordinator shows joining ([] if it does not answer: the
    retirement's own call then says why)."""
    try:
        status = deployment.deployment_status()
    except (ValueError, ConnectionError, TimeoutError, OSError):
        return []
    return [r.rank for r in status.ranks if r.rank in ranks and r.state == SlotState.JOINING]


def _cannot_finish(deployment: Deployment, leaving: list[int]) -> str | None:
    """Why the retirement of ``leaving`` cannot finish (the other nodes are stopping
    too, or the leader does not answer), or None."""
    try:
        status = deployment.deployment_status()
    except (ValueError, ConnectionError, TimeoutError, OSError) as exc:
        return f"the coordinator does not answer ({exc})"
    if not any(r.rank not in leaving and r.state == SlotState.HEALTHY
               for r in status.ranks):
        return "no other rank is healthy (the other nodes are stopping too)"
    return None
