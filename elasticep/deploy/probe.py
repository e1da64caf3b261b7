"""Reaching the coordinator from another node or a `join`, within a bounded time, and
saying what was reached when it is not a coordinator.

A refused or unanswered connection is retried until the deadline (node 0 may still be
starting). Something that accepts the connection but fails the handshake is not retried:
it is named at once (an HTTP server is usually serve's ``--port`` given by mistake).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from elasticep.membership import CoordinatorClient
from elasticep.membership.protocol import parse_address
from elasticep.utils.wait import wait_until

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0  # a live coordinator answers the hello in milliseconds
LOG_EVERY_S = 5.0  # one "waiting" line per this many seconds, not one per attempt


class NotACoordinatorError(ConnectionError):
    """The address accepted a connection but did not answer as an ElasticEP coordinator."""


def _listens(host: str, port: int, timeout_s: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _speaks_http(host: str, port: int, timeout_s: float) -> bool:
    """True if the endpoint answers a minimal HTTP request with an HTTP status line."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
            return sock.recv(5) == b"HTTP/"
    except OSError:
        return False


def reach_coordinator(address: str, timeout_s: float, flag: str = "--dist-init-addr",
                      stop: threading.Event | None = None) -> bool:
    """Wait until the coordinator at ``address`` (``"host:port"``) answers its handshake.

    Args:
        address: the coordinator's ``"host:port"``.
        timeout_s: how long to keep trying a refused or unanswered connection (seconds).
        flag: the flag that gave ``address``, for messages.
        stop: when set, give up early and return False.

    Returns:
        True once a coordinator answered; False if ``stop`` was set first.

    Raises:
        NotACoordinatorError: something listens at ``address`` but is not a coordinator
            (the message says what, e.g. an HTTP server).
        TimeoutError: nothing answered within ``timeout_s``.
    """
    return _reach(address, timeout_s, flag, stop)[0]


def _reach(address: str, timeout_s: float, flag: str, stop: threading.Event | None
           ) -> tuple[bool, int]:
    """:func:`reach_coordinator`, also returning how many attempts failed first."""
    host, port = parse_address(address)
    handshake_s = min(HANDSHAKE_TIMEOUT_S, max(timeout_s, 0.5))
    logged = [-LOG_EVERY_S]
    failed = [0]

    def attempt() -> bool:
        if not _listens(host, port, handshake_s):
            failed[0] += 1
            if time.monotonic() - logged[0] >= LOG_EVERY_S:
                logged[0] = time.monotonic()
                logger.info("waiting for the coordinator at %s (up to %g s)", address,
                            timeout_s)
            return False
        try:
            CoordinatorClient(address, timeout_s=handshake_s).close()
            return True
        except (OSError, TimeoutError, ValueError):
            pass
        what = ("an HTTP server (serve's --port?)" if _speaks_http(host, port, handshake_s)
                else "something that does not speak the coordinator protocol")
        raise NotACoordinatorError(
            f"{flag} {address} is {what}, not an ElasticEP coordinator: give the address "
            "serve prints as 'coordinator HOST:PORT'")

    try:
        reached = bool(wait_until(attempt, timeout_s, f"the coordinator at {address}",
                                  poll_s=0.5, stop=stop))
    except TimeoutError:
        raise TimeoutError(f"no coordinator answered at {flag} {address} within "
                           f"{timeout_s:g} s (--coordinator-timeout)") from None
    return reached, failed[0]


def coordinator_lost(address: str, timeout_s: float, stop: threading.Event | None = None,
                     relaunch_hint: str = "") -> str | None:
    """After this node's ranks all stopped: was the coordinator lost? Keep trying it for
    ``timeout_s`` seconds.

    Args:
        address: the coordinator's ``"host:port"``.
        timeout_s: how long to keep trying (seconds; ``--coordinator-timeout``).
        stop: when set, give up early.
        relaunch_hint: what to tell the user if the coordinator comes back (the ranks
            stay stopped: nothing here relaunches them).

    Returns:
        The one-line reason: the coordinator stayed unreachable, or it was unreachable
        and answers again (then ``relaunch_hint`` follows). None if it answered at once
        (the ranks stopped for another reason, e.g. an eviction) or ``stop`` was set.
    """
    started = time.monotonic()
    try:
        reached, failed = _reach(address, timeout_s, "--dist-init-addr", stop)
    except (TimeoutError, NotACoordinatorError) as exc:
        return f"lost the coordinator: {exc}; the ranks of this node stopped"
    if not reached or not failed:
        return None
    return (f"the coordinator at {address} was unreachable for "
            f"{time.monotonic() - started:.0f} s and the ranks of this node stopped; it "
            f"answers again{': ' + relaunch_hint if relaunch_hint else ''}")
