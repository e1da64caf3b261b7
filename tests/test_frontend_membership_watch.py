"""The front-end's membership watcher while the coordinator cannot be reached: every
poll fails, and the log says so once when the failures start and once when snapshots
succeed again (it used to log one warning a poll, about 20 lines a second)."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from elasticep.frontend.core import Frontend, FrontendConfig
from elasticep.frontend.membership_watch import SnapshotOutage
from elasticep.frontend_link import FrontendChannel
from elasticep.membership.status import DeploymentStatus

pytestmark = pytest.mark.timeout(30)

FAILED = "membership snapshot failed"
BACK = "membership snapshots succeed again"


class UnreachableThenBack:
    """A coordinator that refuses ``status`` until ``down`` is cleared."""

    def __init__(self) -> None:
        self.down = True
        self.failed = self.answered = 0

    def status(self) -> DeploymentStatus:
        if self.down:
            self.failed += 1
            raise ConnectionRefusedError("coordinator at 127.0.0.1:9 refused the connection")
        self.answered += 1
        return DeploymentStatus.from_dict(
            {"epoch": 4, "ep_size": 1, "max_ep_size": 1, "scale_phase": "idle",
             "ranks": [{"rank": 0, "state": "healthy", "pid": 1, "node": 0}]})

    def scale(self, new_ep_size: int, operation_id: str | None = None) -> None:
        raise ValueError("not in this test")


async def _until(done, poll_s: float = 0.005) -> None:
    while not done():
        await asyncio.sleep(poll_s)


def _messages(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


def test_an_unreachable_coordinator_is_logged_when_it_starts_and_when_it_ends(caplog):
    caplog.set_level(logging.INFO, logger="elasticep.frontend")
    membership = UnreachableThenBack()
    channel = FrontendChannel()
    frontend = Frontend(channel, membership, lambda ids: "",
                        config=FrontendConfig(membership_poll_s=0.005))

    async def outage_then_recovery() -> None:
        await frontend.start()
        try:
            await _until(lambda: membership.failed >= 15)
            membership.down = False
            await _until(lambda: membership.answered >= 5)
        finally:
            await frontend.stop()

    try:
        asyncio.run(outage_then_recovery())
    finally:
        channel.close()
    failed = _messages(caplog, FAILED)
    assert [r.levelno for r in failed] == [logging.WARNING]
    assert "refused the connection" in failed[0].getMessage()
    back = _messages(caplog, BACK)
    assert [r.levelno for r in back] == [logging.INFO]
    assert f"({membership.failed} polls failed)" in back[0].getMessage()
    assert frontend.status().epoch == 4  # the snapshot after the outage was applied


def test_each_outage_is_timed_from_its_first_failure(caplog):
    caplog.set_level(logging.INFO, logger="elasticep.frontend")
    now = [100.0]
    outage = SnapshotOutage(clock=lambda: now[0])
    outage.succeeded(3)  # no outage yet: nothing to say
    for _ in range(4):
        outage.failed(3, TimeoutError("no answer in 2 s"))
        now[0] += 0.5
    outage.succeeded(3)
    now[0] = 200.0
    outage.failed(5, OSError("host unreachable"))
    now[0] = 201.25
    outage.succeeded(5)
    outage.succeeded(5)
    assert [re.sub(r"\(.*\)", "", r.getMessage()).split(";")[0]
            for r in _messages(caplog, "membership snapshot")] == [
        "epoch 3: membership snapshot failed: TimeoutError",
        "epoch 3: membership snapshots succeed again after 2.0 s ",
        "epoch 5: membership snapshot failed: OSError",
        "epoch 5: membership snapshots succeed again after 1.2 s ",
    ]
    assert "(4 polls failed)" in _messages(caplog, BACK)[0].getMessage()
    assert "(1 polls failed)" in _messages(caplog, BACK)[1].getMessage()
