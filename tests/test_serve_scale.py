"""`elasticep serve` end to end: EP4 -> EP6 -> EP5 under load, then failures after it.

One deployment for the module (EP4, capacity 6, 16 redundant slots, and
``--restart-failed-ranks``). Tests run in file order.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from _serve_harness import (
    MAX_TOKENS,
    PROMPTS,
    Burst,
    StreamResult,
    fault_midstream,
    reference_results,
    serve_fixture,
    signal_pid,
    stream,
)

from elasticep.utils.procs import pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

serve = serve_fixture("--ep-size", "4", "--max-ep-size", "6", "--ep-num-redundant-experts", "16",
                      "--heartbeat-timeout", "3.0", "--max-total-tokens", "2048",
                      "--restart-failed-ranks")


@pytest.fixture(scope="module")
def reference(serve):
    """Fault-free greedy texts at EP4, computed once."""
    return [r.text for r in reference_results(serve, PROMPTS, MAX_TOKENS)]


class Load:
    """Streaming clients that run until stopped; ``results`` holds (prompt index,
    result) of every request, for comparison with the EP4 reference."""

    def __init__(self, serve, n_clients: int = 3) -> None:
        self.results: list[tuple[int, StreamResult]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(serve, i), daemon=True)
                         for i in range(n_clients)]
        for t in self._threads:
            t.start()

    def _loop(self, serve, i: int) -> None:
        client = serve.client
        while not self._stop.is_set():
            k = i % len(PROMPTS)
            self.results.append((k, stream(client, PROMPTS[k], MAX_TOKENS)))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def _states(st: dict) -> dict[int, str]:
    return {r["rank"]: r["state"] for r in st["ranks"]}


def _healthy(st: dict) -> list[int]:
    return [r for r, s in _states(st).items() if s == "healthy"]


def test_scale_up_then_down_under_load(serve, reference):
    load = Load(serve)
    try:
        # Ask first: the scale waits for its joiners (they take seconds to start), and a
        # second change is refused meanwhile.
        reply = httpx.post(f"{serve.url}/scale_elastic_ep", json={"new_ep_size": 6}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert serve.status()["scale_phase"] == "waiting_for_joiners"
        busy = httpx.post(f"{serve.url}/scale_elastic_ep", json={"new_ep_size": 3}, timeout=30)
        assert busy.status_code == 409, busy.text
        join = serve.join("--elastic-ep-join-mode", "scale", "--elastic-ep-join-rank-offset",
                          "4", "--nranks", "2")
        st = serve.wait_for(lambda s: _healthy(s) == [0, 1, 2, 3, 4, 5]
                            and s["scale_phase"] == "idle", 120, "EP6", watch=(join,))
        assert st["ep_size"] == 6
        time.sleep(1.0)  # new ranks take requests once their workers said hello
        # six more streams on top of the load's three: a new request goes to the rank
        # running the fewest (lowest id on ties), so the joined ranks 4 and 5 take some
        at_ep6 = Burst(serve.client, PROMPTS[:6], MAX_TOKENS).results()
        assert [(r.error, r.text) for r in at_ep6] == [(None, t) for t in reference[:6]]
        seen: list[str] = []

        def removed(s: dict) -> bool:
            state = _states(s)[5]
            if not seen or seen[-1] != state:
                seen.append(state)
            return state == "free" and s["scale_phase"] == "idle"

        reply = httpx.post(f"{serve.url}/scale_elastic_ep", json={"new_ep_size": 5}, timeout=30)
        assert reply.status_code == 200, reply.text
        st = serve.wait_for(removed, 120, "rank 5 removed", poll_s=0.02)
        assert st["ep_size"] == 5 and _healthy(st) == [0, 1, 2, 3, 4]
        assert "draining" in seen or seen[0] == "free", seen
        assert join.poll() is None, "join keeps supervising rank 4"
    finally:
        load.stop()
    assert load.results, "the load sent no request"
    # greedy outputs do not depend on the EP size: every text through EP4 -> EP6 -> EP5
    # is the EP4 reference's
    assert [(k, r.error, r.text) for k, r in load.results] == [
        (k, None, reference[k]) for k, _ in load.results]


def test_kill_after_scale_is_survived_and_restarted(serve, reference):
    victim = serve.rank(1)
    fault_midstream(serve, PROMPTS, MAX_TOKENS, reference, victim["pid"], signal.SIGKILL)
    # --restart-failed-ranks relaunches serve's own crashed rank...
    st = serve.wait_for(lambda s: serve.rank(1)["state"] == "healthy"
                        and serve.rank(1)["pid"] != victim["pid"], 120, "rank 1 restarted")
    # ... and never the rank removed on purpose.
    assert _states(st)[5] == "free"
    assert not pid_alive(victim["pid"])


def test_kill_a_scaled_in_rank(serve, reference):
    victim = serve.rank(4)
    assert victim["state"] == "healthy"
    fault_midstream(serve, PROMPTS, MAX_TOKENS, reference, victim["pid"], signal.SIGKILL)
    # a `join` started rank 4 on serve's node: --restart-failed-ranks relaunches it all
    # the same (a rank of the node is restarted whoever launched it)
    serve.wait_for(lambda s: serve.rank(4)["state"] == "healthy"
                   and serve.rank(4)["pid"] != victim["pid"], 120, "rank 4 relaunched")


def test_frozen_rank_is_killed_and_restarted(serve, reference):
    """--restart-failed-ranks: a SIGSTOPped rank is evicted, its frozen process killed
    (never resumed into the deployment) and its slot relaunched."""
    victim = serve.rank(2)
    signal_pid(victim["pid"], signal.SIGSTOP)
    serve.wait_for(lambda s: serve.rank(2)["state"] != "healthy", 30, "rank 2 evicted")
    serve.wait_for(lambda s: serve.rank(2)["state"] == "healthy"
                   and serve.rank(2)["pid"] != victim["pid"], 120, "rank 2 relaunched")
    assert not pid_alive(victim["pid"])
    ok = stream(serve.client, PROMPTS[0], MAX_TOKENS)
    assert (ok.error, ok.text) == (None, reference[0])


def test_scale_down_of_a_serve_rank_is_never_restarted(serve, reference):
    """Rank 3 is serve's own child, and serve runs with --restart-failed-ranks: once a
    scale-down removed it on purpose, it stays removed."""
    victim = serve.rank(3)
    assert victim["state"] == "healthy"
    reply = httpx.post(f"{serve.url}/scale_elastic_ep", json={"new_ep_size": 3}, timeout=30)
    assert reply.status_code == 200, reply.text
    serve.wait_for(lambda s: serve.rank(3)["state"] == "free"
                   and s["scale_phase"] == "idle", 60, "rank 3 removed")
    deadline = time.monotonic() + 10
    while pid_alive(victim["pid"]):
        assert time.monotonic() < deadline, "the removed worker did not exit"
        time.sleep(0.1)
    time.sleep(1.5)  # several supervisor periods: no relaunch may happen
    after = serve.rank(3)
    assert after["state"] == "free" and after["pid"] == victim["pid"], after
    ok = stream(serve.client, PROMPTS[0], MAX_TOKENS)
    assert (ok.error, ok.text) == (None, reference[0])


def test_killed_serve_leaves_no_orphans(serve):
    """SIGKILL on serve itself: its workers die with it (PR_SET_PDEATHSIG); the joined
    ranks lose the coordinator and exit, and so does their `join`."""
    pids = serve.seen_pids | {r["pid"] for r in serve.status()["ranks"] if r["pid"]}
    serve.proc.kill()
    serve.proc.wait(10)
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in pids) or any(j.poll() is None for j in serve.joins):
        assert time.monotonic() < deadline, [p for p in pids if pid_alive(p)]
        time.sleep(0.1)
