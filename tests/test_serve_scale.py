"""`elasticep serve` end to end: EP4 -> EP6 -> EP5 under load, then failures after it.

One deployment for the module (EP4, capacity 6, 16 redundant slots, and
``--restart-failed-ranks``). Tests run in file order.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from _serve_fixtures import (
    JOIN_COORDINATOR_TIMEOUT_S,
    MAX_TOKENS,
    PROMPTS,
    RESULTS_TIMEOUT_S,
    assert_complete,
    burst,
    fault_midstream,
    reference_results,
    serve_fixture,
    stream,
)

from elasticep.frontend.event_log import read_events
from elasticep.membership.status import DeploymentStatus
from elasticep.membership.transitions import ScalePhase, SlotState
from elasticep.utils.procs import pid_alive
from elasticep.utils.wait import wait_until
from elasticep_testkit.harness.load import SteadyLoad

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# every membership and recovery event of the module's deployment, as serve writes them
EVENTS = Path(tempfile.mkdtemp(prefix="elasticep-scale-events-")) / "events.jsonl"
serve = serve_fixture("--ep-size", "4", "--max-ep-size", "6", "--ep-num-redundant-experts", "16",
                      "--heartbeat-timeout", "3.0", "--max-total-tokens", "2048",
                      "--restart-failed-ranks", "--event-log", str(EVENTS),
                      "--log-stats-interval", "1")


@pytest.fixture(scope="module")
def reference(serve):
    """Fault-free greedy texts at EP4, computed once."""
    return reference_results(serve, PROMPTS, MAX_TOKENS)


def _relaunched(rank: int, old_pid: int):
    """A status predicate: ``rank`` is healthy again, in a new process."""
    return lambda s: s.rank(rank).state == SlotState.HEALTHY and s.rank(rank).pid != old_pid


def test_retire_rank_1_under_load_then_join_it_back(serve, reference):
    """Retire rank 1 of EP4 (not the highest) under streaming load, by operation id;
    then `join` in recover mode takes the slot back in place. No request fails, and
    every text is the fault-free run's."""
    url = f"{serve.url}/scale_elastic_ep"
    load = SteadyLoad(serve.client, serve.model_name(), PROMPTS, 3, MAX_TOKENS)
    seen: list[tuple[str, str]] = []
    try:
        time.sleep(1.0)  # the streams are running on every rank
        body = {"retire_ranks": [1], "operation_id": "retire-1"}
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"status": "accepted", "retire_ranks": [1], "old_ep_size": 4,
                                "slots": [1], "scale_phase": "draining",
                                "operation_id": "retire-1"}
        again = httpx.post(url, json=body, timeout=30)  # a retry: same operation
        assert again.status_code == 200 and again.json()["repeated"] is True, again.text
        conflict = httpx.post(url, json={**body, "retire_ranks": [2]}, timeout=30)
        assert conflict.status_code == 409, conflict.text

        def done() -> bool:
            op = httpx.get(f"{url}/retire-1", timeout=10).json()
            state = (op["phase"], op["ranks"][0]["state"])
            if not seen or seen[-1] != state:
                seen.append(state)
            return op["phase"] == "done"

        wait_until(done, 60, "rank 1 safe to terminate", poll_s=0.05)
        # the retired worker's exit reaches the coordinator a moment after the operation
        # is done (on a loaded machine, seconds): until then its slot may not read free
        serve.wait_for(lambda s: s.ep_size == 3 and s.healthy_ranks() == [0, 2, 3]
                       and not s.degraded(), 15, "EP3 without rank 1, not degraded")
        assert httpx.get(f"{url}/nope", timeout=10).status_code == 404
        join = serve.join("--elastic-ep-join-mode", "recover", "--ranks", "1",
                          coordinator_timeout_s=JOIN_COORDINATOR_TIMEOUT_S)
        serve.wait_for(lambda s: s.healthy_ranks() == [0, 1, 2, 3] and s.ep_size == 4
                       and s.scale_phase == ScalePhase.IDLE, 120, "rank 1 back",
                       watch=(join,))
    finally:
        records = load.stop(RESULTS_TIMEOUT_S)
    assert seen[-1] == ("done", "safe_to_terminate"), seen
    # the same story in the event log and /metrics
    events = read_events(EVENTS)
    rank1 = [e["state"] for e in events if e["event"] == "rank_state" and e["rank"] == 1]
    assert rank1[-1] == "healthy" and "free" in rank1, rank1
    done = [e for e in events if e["event"] == "scale_done" and e["kind"] == "retire"]
    assert len(done) == 1 and 0 < done[0]["seconds"] < 60, done
    text = httpx.get(f"{serve.url}/metrics", timeout=10).text
    assert 'elasticep_scale_seconds_count{kind="retire"} 1.0' in text
    assert 'elasticep_rank_state{rank="1",state="healthy"} 1.0' in text
    # 32 slots per layer (16 experts + 16 redundant) over EP4: the ranks that stayed hold
    # all 8 of theirs (the rejoined one holds what the reconcile gave it)
    held = serve.rank_metric("elasticep_rank_experts_held")
    assert all(held.get(r) == 8 for r in (0, 2, 3)), held
    assert all(phase in ("draining", "retiring", "done") for phase, _ in seen), seen
    assert records, "the load sent no request"
    assert_complete(records, MAX_TOKENS)
    assert [(r.prompt_idx, r.text) for r in records] == [
        (r.prompt_idx, reference[r.prompt_idx]) for r in records]



def _reported_members(out: str) -> set[int]:
    """The ranks `join` said became members: one "admitted: ranks [...]" line per
    admission it saw (4 and 5 come in one line, or in two when they were admitted in
    different epochs, as a clean-clone CI run saw)."""
    found = re.findall(r"^admitted: ranks \[([0-9, ]+)\] are members", out, re.M)
    return {int(r) for group in found for r in group.split(",")}

def test_scale_up_then_down_under_load(serve, reference):
    # three streams kept busy through the whole scale, round robin over the prompts
    load = SteadyLoad(serve.client, serve.model_name(), PROMPTS, 3, MAX_TOKENS)
    records = []
    try:
        # Ask first: the scale waits for its joiners (they take seconds to start), and a
        # second change is refused meanwhile.
        reply = httpx.post(f"{serve.url}/scale_elastic_ep", json={"new_ep_size": 6}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert serve.status().scale_phase == ScalePhase.WAITING_FOR_JOINERS
        busy = httpx.post(f"{serve.url}/scale_elastic_ep", json={"new_ep_size": 3}, timeout=30)
        assert busy.status_code == 409, busy.text
        join = serve.join("--elastic-ep-join-mode", "scale", "--elastic-ep-join-rank-offset",
                          "4", "--nranks", "2", coordinator_timeout_s=JOIN_COORDINATOR_TIMEOUT_S)
        st = serve.wait_for(lambda s: s.healthy_ranks() == [0, 1, 2, 3, 4, 5]
                            and s.scale_phase == ScalePhase.IDLE, 120, "EP6", watch=(join,))
        assert st.ep_size == 6
        # join said when its loaded ranks became members, not only that they loaded
        wait_until(lambda: _reported_members(join.output()) == {4, 5}, 10,
                   "join to report the admission", poll_s=0.1, last=join.output)
        time.sleep(1.0)  # new ranks take requests once their workers said hello
        # six more streams on top of the load's three: a new request goes to the rank
        # running the fewest (lowest id on ties), so the joined ranks 4 and 5 take some
        at_ep6 = burst(serve, PROMPTS[:6], MAX_TOKENS).results(RESULTS_TIMEOUT_S)
        assert_complete(at_ep6, MAX_TOKENS)
        assert [r.text for r in at_ep6] == reference[:6]
        seen: list[str] = []

        def removed(s: DeploymentStatus) -> bool:
            state = s.rank(5).state
            if not seen or seen[-1] != state:
                seen.append(state)
            return state == SlotState.FREE and s.scale_phase == ScalePhase.IDLE

        reply = httpx.post(f"{serve.url}/scale_elastic_ep", json={"new_ep_size": 5}, timeout=30)
        assert reply.status_code == 200, reply.text
        st = serve.wait_for(removed, 120, "rank 5 removed", poll_s=0.02)
        assert st.ep_size == 5 and st.healthy_ranks() == [0, 1, 2, 3, 4]
        assert "draining" in seen or seen[0] == "free", seen
        assert join.proc.poll() is None, "join keeps supervising rank 4"
    finally:
        records = load.stop(RESULTS_TIMEOUT_S)
    assert records, "the load sent no request"
    # greedy outputs do not depend on the EP size: every text through EP4 -> EP6 -> EP5
    # is the EP4 reference's
    assert_complete(records, MAX_TOKENS)
    assert [(r.prompt_idx, r.text) for r in records] == [
        (r.prompt_idx, reference[r.prompt_idx]) for r in records]


def test_kill_after_scale_is_survived_and_restarted(serve, reference):
    victim = serve.rank_state(1)
    fault_midstream(serve, PROMPTS, MAX_TOKENS, reference, victim.pid, signal.SIGKILL)
    # --restart-failed-ranks relaunches serve's own crashed rank...
    st = serve.wait_for(_relaunched(1, victim.pid), 120, "rank 1 restarted")
    # ... and never the rank removed on purpose.
    assert st.rank(5).state == SlotState.FREE
    assert not pid_alive(victim.pid)


def test_kill_a_scaled_in_rank(serve, reference):
    victim = serve.rank_state(4)
    assert victim.state == SlotState.HEALTHY
    fault_midstream(serve, PROMPTS, MAX_TOKENS, reference, victim.pid, signal.SIGKILL)
    # a `join` started rank 4 on serve's node: --restart-failed-ranks relaunches it all
    # the same (a rank of the node is restarted whoever launched it)
    serve.wait_for(_relaunched(4, victim.pid), 120, "rank 4 relaunched")


def test_frozen_rank_is_killed_and_restarted(serve, reference):
    """--restart-failed-ranks: a SIGSTOPped rank is evicted, its frozen process killed
    (never resumed into the deployment) and its slot relaunched."""
    victim = serve.rank_state(2)
    os.kill(victim.pid, signal.SIGSTOP)
    serve.wait_for(lambda s: s.rank(2).state != SlotState.HEALTHY, 30, "rank 2 evicted")
    serve.wait_for(_relaunched(2, victim.pid), 120, "rank 2 relaunched")
    assert not pid_alive(victim.pid)
    ok = stream(serve, PROMPTS[0], MAX_TOKENS)
    assert ok.complete(MAX_TOKENS) and ok.text == reference[0], ok


def test_scale_down_of_a_serve_rank_is_never_restarted(serve, reference):
    """Rank 3 is serve's own child, and serve runs with --restart-failed-ranks: once a
    scale-down removed it on purpose, it stays removed."""
    victim = serve.rank_state(3)
    assert victim.state == SlotState.HEALTHY
    reply = httpx.post(f"{serve.url}/scale_elastic_ep", json={"new_ep_size": 3}, timeout=30)
    assert reply.status_code == 200, reply.text
    serve.wait_for(lambda s: s.rank(3).state == SlotState.FREE
                   and s.scale_phase == ScalePhase.IDLE, 60, "rank 3 removed")
    wait_until(lambda: not pid_alive(victim.pid), 10, "the removed worker to exit", poll_s=0.1)
    time.sleep(1.5)  # several supervisor periods: no relaunch may happen
    after = serve.rank_state(3)
    # a relaunch would show the slot joining with a new pid; a free slot whose worker
    # exited shows none
    assert after.state == SlotState.FREE and after.pid is None, after
    ok = stream(serve, PROMPTS[0], MAX_TOKENS)
    assert ok.complete(MAX_TOKENS) and ok.text == reference[0], ok


def test_retire_with_keep_processes_leaves_the_worker_up_idle(serve, reference):
    """Rank 3 was removed without keep_processes: its worker exited. Rank 2, retired
    with it, stays up, idle and out of the group; the operation is done with it safe to
    terminate, serve does not restart it, and SIGTERM ends it with status 0."""
    assert serve.rank_state(3).pid is None  # removed by the test above: exited
    kept = serve.rank_state(2)
    url = f"{serve.url}/scale_elastic_ep"
    body = {"retire_ranks": [2], "keep_processes": True, "operation_id": "keep-2"}
    reply = httpx.post(url, json=body, timeout=30)
    assert reply.status_code == 200 and reply.json()["keep_processes"] is True, reply.text
    wait_until(lambda: httpx.get(f"{url}/keep-2", timeout=10).json()["phase"] == "done", 60,
               "rank 2 out of the group", poll_s=0.1)
    assert httpx.get(f"{url}/keep-2", timeout=10).json()["ranks"] == [
        {"rank": 2, "state": "safe_to_terminate", "process_running": True}]
    serve.wait_for(lambda s: s.healthy_ranks() == [0, 1] and s.scale_phase == ScalePhase.IDLE,
                   30, "EP2 without rank 2")
    time.sleep(1.5)  # several supervisor periods: no relaunch, and it does not exit
    after = serve.rank_state(2)
    assert after.state == SlotState.FREE and after.pid == kept.pid, after
    assert pid_alive(kept.pid)
    ok = stream(serve, PROMPTS[0], MAX_TOKENS)
    assert ok.complete(MAX_TOKENS) and ok.text == reference[0], ok
    os.kill(kept.pid, signal.SIGTERM)
    wait_until(lambda: not pid_alive(kept.pid), 15, "the kept worker to exit", poll_s=0.1)
    wait_until(lambda: not httpx.get(f"{url}/keep-2", timeout=10).json()["ranks"][0][
        "process_running"], 15, "the coordinator to see it gone", poll_s=0.1)
    assert serve.rank_state(2).state == SlotState.FREE and serve.proc.poll() is None
    log = serve.rank_log(2)
    assert "staying up, idle, until stopped (keep_processes)" in log, log[-3000:]
    assert "stopped while idle; exiting cleanly" in log, log[-3000:]
    wait_until(lambda: f"rank 2 (pid {kept.pid}) left after a planned removal" in serve.tail(
        20000), 10, "serve to log the kept worker's clean exit", poll_s=0.1)


def test_killed_serve_leaves_no_orphans(serve):
    """SIGKILL on serve itself: its workers die with it (PR_SET_PDEATHSIG); the joined
    ranks lose the coordinator and exit, and so does their `join`."""
    pids = (serve.seen_pids | set(serve.status().pids().values())
            | serve.note_descendants()) - {serve.proc.pid}
    serve.proc.kill()
    serve.proc.wait(10)
    wait_until(lambda: not any(pid_alive(p) for p in pids)
               and all(j.poll() is not None for j in serve.joins), 15, "every process to exit",
               poll_s=0.1, last=lambda: sorted(p for p in pids if pid_alive(p)))
