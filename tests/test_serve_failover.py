"""`elasticep serve` end to end: rank death, a frozen rank, rejoin, bad requests, Ctrl-C.

One EP4 deployment of the demo model for the whole module (2-core budget). The tests
run in file order and each one leaves the deployment back at four healthy ranks by
relaunching the slot it broke with `elasticep join ... recover`.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from _serve_fixtures import (
    JOIN_COORDINATOR_TIMEOUT_S,
    MAX_TOKENS,
    N_STREAMS,
    PROMPTS,
    RESULTS_TIMEOUT_S,
    burst,
    fault_midstream,
    reference_results,
    serve_fixture,
    stream,
)

from elasticep.membership.status import DeploymentStatus, RankStatus
from elasticep.membership.transitions import ScalePhase, SlotState
from elasticep.utils.procs import pid_alive
from elasticep.utils.wait import wait_until
from elasticep_testkit.harness.serve_process import Joiner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

serve = serve_fixture("--ep-size", "4", "--ep-num-redundant-experts", "4",
                      "--heartbeat-timeout", "3.0", "--max-total-tokens", "2048")


@pytest.fixture(scope="module")
def reference(serve):
    """Fault-free greedy texts, computed once on the healthy deployment (each stream
    complete: all MAX_TOKENS tokens)."""
    return reference_results(serve, PROMPTS, MAX_TOKENS)


def _all_healthy(st: DeploymentStatus) -> bool:
    return len(st.healthy_ranks()) == st.ep_size


def _fault_midstream(serve, reference, rank: int, sig: int) -> RankStatus:
    """Run 8 streams, signal ``rank``'s worker when they are partway; check the texts."""
    victim = serve.rank_state(rank)
    assert victim.state == SlotState.HEALTHY
    fault_midstream(serve, PROMPTS, MAX_TOKENS, reference, victim.pid, sig)
    return victim


def _join(serve, *args: str):
    return serve.join(*args, coordinator_timeout_s=JOIN_COORDINATOR_TIMEOUT_S)


# rank -> the `join` that last recovered it (tests run in file order)
_REJOINED: dict[int, Joiner] = {}


def _rejoin(serve, rank: int) -> None:
    """`elasticep join ... recover` for ``rank``; see failed -> joining -> healthy."""
    join = _join(serve, "--elastic-ep-join-mode", "recover", "--ranks", str(rank))
    _REJOINED[rank] = join
    seen: list[str] = []

    def back(st: DeploymentStatus) -> bool:
        state = st.rank(rank).state
        if not seen or seen[-1] != state:
            seen.append(state)
        return state == SlotState.HEALTHY and _all_healthy(st)

    serve.wait_for(back, 120, f"rank {rank} to rejoin", poll_s=0.02, watch=(join,))
    assert join.proc.poll() is None, "join must stay in the foreground supervising its rank"
    # "joining" while it loads (launched, not registered yet); "ready" may last less
    # than one poll before the survivors admit it.
    assert seen[0] == "failed" and seen[1] == "joining" and seen[-1] == "healthy", seen
    assert [s for s in seen[1:-1] if s not in ("joining", "ready")] == [], seen


def test_reference_is_served(serve, reference):
    st = serve.status()
    assert st.ep_size == 4 and _all_healthy(st) and st.scale_phase == ScalePhase.IDLE
    assert all(r.node == 0 and r.pid for r in st.ranks[:4])


def test_kill_worker_midstream_then_rejoin(serve, reference):
    victim = _fault_midstream(serve, reference, 2, signal.SIGKILL)
    st = serve.wait_for(lambda s: s.rank(2).state == SlotState.FAILED, 10, "rank 2 failed")
    assert st.epoch >= 1
    health = httpx.get(f"{serve.url}/health").json()
    assert health["status"] == "ok" and health["degraded"] is True
    assert not pid_alive(victim.pid)
    _rejoin(serve, 2)
    # New requests land on the relaunched rank (routable once its worker said hello,
    # a moment after the coordinator marks it healthy).
    time.sleep(1.0)
    b = burst(serve, PROMPTS, MAX_TOKENS)
    running = [0]

    def half_streamed() -> bool:
        running[0] = max(running[0], serve.rank_state(2).running_requests)
        return b.tokens() >= N_STREAMS * MAX_TOKENS // 2

    wait_until(half_streamed, 60, "half of the burst's tokens", poll_s=0.05)
    assert [r.text for r in b.results(RESULTS_TIMEOUT_S)] == reference
    assert running[0] > 0


def test_join_refuses_a_healthy_slot(serve):
    join = _join(serve, "--elastic-ep-join-mode", "recover", "--ranks", "1")
    assert join.proc.wait(60) == 2, join.output()
    assert serve.rank_state(1).state == SlotState.HEALTHY


def test_kill_rank0_midstream(serve, reference):
    _fault_midstream(serve, reference, 0, signal.SIGKILL)
    _rejoin(serve, 0)


def test_ctrl_c_of_a_join_hands_its_rank_over_and_detach_returns(serve, reference):
    """SIGINT to the `join` that recovered rank 0 (the test above): the join exits 130
    with one line; rank 0 keeps its pid and stays healthy past a heartbeat timeout, and
    a burst of 8 streams over the 4 ranks gives the fault-free texts. Then, with rank 0
    killed, `join --detach` recovers it, exits 0 once it is healthy, and leaves it
    running."""
    join = _REJOINED[0]
    assert join.proc.poll() is None, join.output()
    before = serve.rank_state(0)
    join.proc.send_signal(signal.SIGINT)
    assert join.proc.wait(30) == 130, join.output()
    assert f"ranks [0] (pids [{before.pid}]) keep serving" in join.output()
    # the marker files by which the kept rank confirmed it outlives the join are gone
    assert not list(Path(tempfile.gettempdir()).glob(f"elasticep-outlive-{join.proc.pid}-r*"))
    time.sleep(3.5)  # longer than --heartbeat-timeout 3.0: a dead rank would be failed
    assert reference_results(serve, PROMPTS, MAX_TOKENS) == reference
    now = serve.rank_state(0)
    assert (now.state, now.pid) == (SlotState.HEALTHY, before.pid)
    assert _all_healthy(serve.status()) and pid_alive(before.pid)
    assert httpx.get(f"{serve.url}/health").json()["degraded"] is False

    os.kill(before.pid, signal.SIGKILL)  # the coordinator tracks it: failed
    serve.wait_for(lambda s: s.rank(0).state == SlotState.FAILED, 10, "rank 0 failed")
    detached = _join(serve, "--elastic-ep-join-mode", "recover", "--ranks", "0", "--detach")
    assert detached.proc.wait(120) == 0, detached.output()
    assert not list(Path(tempfile.gettempdir()).glob(
        f"elasticep-outlive-{detached.proc.pid}-r*"))
    assert "keep serving" in detached.output()
    back = serve.rank_state(0)
    assert back.state == SlotState.HEALTHY and back.pid != before.pid
    time.sleep(1.0)
    assert pid_alive(back.pid) and _all_healthy(serve.status())


def test_frozen_rank_is_evicted(serve, reference):
    victim = serve.rank_state(1)
    t0 = time.monotonic()
    _fault_midstream(serve, reference, 1, signal.SIGSTOP)
    serve.wait_for(lambda s: s.rank(1).state == SlotState.FAILED, 10, "rank 1 evicted")
    assert time.monotonic() - t0 < 60
    os.kill(victim.pid, signal.SIGCONT)
    # A resumed, evicted rank never comes back by itself: it exits (or is killed by join).
    time.sleep(1.0)
    assert serve.rank_state(1).state == SlotState.FAILED
    _rejoin(serve, 1)
    assert not pid_alive(victim.pid)


def test_malformed_requests_get_4xx_and_serving_continues(serve, reference):
    url = f"{serve.url}/v1/completions"
    model = serve.model_name()
    bad = [
        httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}),
        httpx.post(url, json={"model": model, "prompt": "hi", "bogus_field": 1}),
        httpx.post(url, json={"model": model, "prompt": "hi", "max_tokens": -3}),
        httpx.post(url, json={"model": model, "prompt": "hi " * 5000, "max_tokens": 4}),
        httpx.post(f"{serve.url}/v1/chat/completions",
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}]}),
        httpx.post(f"{serve.url}/scale_elastic_ep", json={"new_ep_size": 9}),
    ]
    for r in bad:
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert r.json()["error"]["message"]
    ok = stream(serve, PROMPTS[0], MAX_TOKENS)
    assert ok.complete(MAX_TOKENS) and ok.text == reference[0], ok


def test_sigint_stops_every_process(serve):
    pids = set(serve.status().pids().values()) | serve.seen_pids
    joins = [p for p in serve.joins if p.poll() is None]
    assert serve.interrupt(timeout_s=30) == 130, serve.tail()  # 128 + SIGINT, as shells report
    # serve alone was interrupted: its workers and the joins (whose coordinator is gone)
    # must all end by themselves
    wait_until(lambda: not any(pid_alive(p) for p in pids | serve.seen_pids)
               and all(j.poll() is not None for j in joins), 15, "every process to exit",
               poll_s=0.1, last=lambda: sorted(p for p in pids if pid_alive(p)))
