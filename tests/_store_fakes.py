"""A fake of the MembershipStore protocol for the tests of what a store outage does
(not a test module)."""

from __future__ import annotations

from elasticep.membership.durable_state import MembershipState
from elasticep.membership.errors import StoreUnavailableError
from elasticep.membership.store import MemoryStore


class DownStore(MemoryStore):
    """The embedded store, but its commits fail as an etcd without quorum's do while
    ``down`` is set (a fake of the store protocol, not of etcd)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def commit(self, state: MembershipState, expected_revision: int) -> int:
        if self.down:
            raise StoreUnavailableError("no etcd member answered (test)")
        return super().commit(state, expected_revision)
