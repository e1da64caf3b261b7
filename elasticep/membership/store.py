"""Where the coordinator's durable state lives: the seam between the membership service
and a store (``--membership-store``).

A store holds one :class:`~elasticep.membership.durable_state.MembershipState` per
deployment, with a revision. Every commit names the revision its writer last read, and
fails with :class:`FencedCommitError` if the state moved since: a coordinator deposed
while it was away cannot overwrite what its successor committed (fencing).

Two backends:
- :class:`MemoryStore` — the embedded coordinator's default, in its own process: no
  install, nothing survives the process (today's behaviour).
- ``etcd_store.EtcdMembershipStore`` — etcd, for standby coordinators on other nodes.

``parse_store_url`` turns the flag's value into a :class:`StoreSpec`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from .durable_state import MembershipState
from .errors import FencedCommitError, PrefixInUseError

DEFAULT_PREFIX = "elasticep"


@dataclass(frozen=True)
class StoreSpec:
    """A parsed ``--membership-store`` value.

    Attributes:
        kind: ``"embedded"`` or ``"etcd"``.
        endpoints: ``(host, port)`` of every etcd member given (empty when embedded).
        prefix: the key prefix of this deployment's records (no slashes at the ends).
    """

    kind: str = "embedded"
    endpoints: tuple[tuple[str, int], ...] = ()
    prefix: str = DEFAULT_PREFIX


def parse_store_url(url: str | None) -> StoreSpec:
    """Parse ``embedded`` (or None/empty) or ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``.

    Raises:
        ValueError: another scheme, an endpoint without a valid port, or none.
    """
    if not url or url == "embedded":
        return StoreSpec()
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "etcd":
        raise ValueError(f"--membership-store must be 'embedded' or "
                         f"etcd://HOST:PORT[,HOST:PORT...][/PREFIX], got {url!r}")
    hosts, _, prefix = rest.partition("/")
    endpoints = []
    for item in hosts.split(","):
        host, colon, port = item.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--membership-store: bad etcd endpoint {item!r} in {url!r} "
                             f"(want HOST:PORT)")
        endpoints.append((host.strip("[]"), int(port)))
    return StoreSpec("etcd", tuple(endpoints), prefix.strip("/") or DEFAULT_PREFIX)


class MembershipStore(Protocol):
    """A durable home for one deployment's membership state."""

    def claim(self, deployment_id: str) -> None:
        """Make this prefix ``deployment_id``'s; a replica of the same deployment may
        claim it again.

        Raises:
            PrefixInUseError: another deployment holds the prefix.
            StoreUnavailableError: the store did not answer.
        """

    def load(self) -> tuple[MembershipState | None, int]:
        """The committed state (None before the first commit) and its revision, which a
        later :meth:`commit` must name.

        Raises:
            StoreUnavailableError: the store did not answer.
        """

    def commit(self, state: MembershipState, expected_revision: int) -> int:
        """Write ``state`` if the committed revision is still ``expected_revision``.

        Returns:
            The new revision (pass it to the next commit).

        Raises:
            FencedCommitError: someone committed since that revision.
            StoreUnavailableError: the store did not answer. The outcome is unknown
                (a member may have logged the write and commit it once quorum is
                back), so the caller must not act on ``state`` and must :meth:`load`
                again before its next commit; fencing keeps that safe.
        """

    def close(self) -> None:
        """Drop connections (the records stay)."""


class MemoryStore:
    """The embedded default: the state in this process's memory, fenced like the others
    so that the service's code path is the same with either backend."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: str | None = None
        self._text: str | None = None
        self._revision = 0

    def claim(self, deployment_id: str) -> None:
        with self._lock:
            if self._owner not in (None, deployment_id):
                raise PrefixInUseError(f"the store is held by deployment {self._owner!r}")
            self._owner = deployment_id

    def load(self) -> tuple[MembershipState | None, int]:
        with self._lock:
            text, rev = self._text, self._revision
        return (None if text is None else MembershipState.from_json(text)), rev

    def commit(self, state: MembershipState, expected_revision: int) -> int:
        with self._lock:
            if expected_revision != self._revision:
                raise FencedCommitError(f"state is at revision {self._revision}, "
                                        f"not {expected_revision}")
            self._text = state.to_json()
            self._revision += 1
            return self._revision

    def close(self) -> None:
        pass
