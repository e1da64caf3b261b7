"""A poison request, then a Ctrl-C, through a real `elasticep serve --ep-size 2
--restart-failed-ranks` (issue 30, items 1 and 5).

``ELASTICEP_FAULT=raise:seed=666`` makes the step of any rank that runs a request with
seed 666 raise (relaunched ranks inherit it, as they would meet a real poison request
again). The request crashes its rank, is retried once on the other, crashes that one
too and then fails with a 500 naming both ranks; the relaunched ranks get nothing back,
the deployment comes back whole and serves the fault-free text.

Then a SIGSTOP of serve for 1, 5 or 20 s costs no request and no rank (its coordinator, a
child process, heartbeats on meanwhile), and Ctrl-C of serve while
streams are open ends them, after the grace period, with an error event saying why, not
with a cut connection.
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest
from _serve_fixtures import MAX_TOKENS, PROMPTS, burst, start_serve, stream

from elasticep.membership import CoordinatorClient
from elasticep.membership.transitions import SlotState
from elasticep.utils.procs import pid_alive

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def serve():
    os.environ["ELASTICEP_FAULT"] = "raise:seed=666"  # inherited by serve and its ranks
    try:
        with start_serve("--ep-size", "2", "--restart-failed-ranks") as s:
            yield s
    finally:
        del os.environ["ELASTICEP_FAULT"]


def _all_healthy(st) -> bool:
    return all(r.state == SlotState.HEALTHY for r in st.ranks[:2])


def test_poison_fails_after_one_retry_and_the_deployment_recovers(serve):
    reference = stream(serve, PROMPTS[0], MAX_TOKENS)
    assert reference.error is None
    pids = {r.rank: r.pid for r in serve.status().ranks[:2]}
    with pytest.raises(openai.InternalServerError) as info:
        serve.client.completions.create(model=serve.model_name(), prompt=PROMPTS[1],
                                        max_tokens=8, temperature=1.0, seed=666, timeout=120)
    message = str(info.value)
    assert "raised on 2 ranks" in message and "not retried again" in message, message
    assert "PoisonFault: fault injection: poison request (seed 666)" in message, message
    st = serve.wait_for(lambda s: _all_healthy(s) and all(
        r.pid not in (None, pids[r.rank]) for r in s.ranks[:2]), 240,
        "both ranks relaunched and healthy")
    new_pids = {r.rank: r.pid for r in st.ranks[:2]}
    again = stream(serve, PROMPTS[0], MAX_TOKENS)
    assert again.error is None and again.text == reference.text
    # the relaunched ranks were not handed the poison back: the same processes serve
    assert {r.rank: r.pid for r in serve.status().ranks[:2]} == new_pids
    assert "request aborted" not in serve.tail(1 << 20)


# What a rank logs when its coordinator falls silent (distributed/control.py), and what
# the coordinator logs when it did not run itself (membership/service.py).
RANK_SAW_SILENCE = "coordinator silent for"
COORDINATOR_STALLED = "coordinator: stalled for"


def _silence_lines(serve) -> int:
    """How many times a rank saw its coordinator silent, or the coordinator itself
    stalled, so far."""
    return (sum(serve.rank_log(r).count(RANK_SAW_SILENCE) for r in range(2))
            + serve.tail(1 << 22).count(COORDINATOR_STALLED))


@pytest.fixture(scope="module")
def stall_reference(serve) -> list[str]:
    """The fault-free texts of the stall tests' burst, computed once for both."""
    records = burst(serve, PROMPTS[:4], MAX_TOKENS).results(120)
    assert [r.error for r in records] == [None] * 4
    return [r.text for r in records]


@pytest.mark.parametrize("stall_s", [1.0, 8.0])
def test_a_stall_of_serve_costs_no_request_and_no_rank(serve, stall_reference, stall_s):
    """SIGSTOP of serve (the front-end) mid-stream for 1 and 8 s (the heartbeat timeout
    is 2 s): with the coordinator inside serve every rank used to exit. The coordinator
    is serve's child process now, so it keeps heartbeating meanwhile: it answers calls
    within a fraction of the timeout, no rank sees it silent and it never stalls
    itself. After SIGCONT every stream ends with its fault-free text, and the same rank
    processes serve on in the same epoch."""
    reference = stall_reference
    before = serve.status()
    coordinator = serve.coordinator_pid()
    assert coordinator not in (None, serve.proc.pid)
    silences = _silence_lines(serve)
    b = burst(serve, PROMPTS[:4], MAX_TOKENS)
    assert b.wait_tokens(4 * 2, 60), f"only {b.tokens()} tokens arrived"
    client = CoordinatorClient(serve.coordinator, timeout_s=10)
    os.kill(serve.proc.pid, signal.SIGSTOP)
    try:
        end, worst, during = time.monotonic() + stall_s, 0.0, []
        while time.monotonic() < end:
            t0 = time.monotonic()
            during.append(client.deployment_status())
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.1)
    finally:
        os.kill(serve.proc.pid, signal.SIGCONT)
        client.close()
    print(f"stall {stall_s:g} s: {len(during)} coordinator calls during it, "
          f"the slowest {worst * 1000:.1f} ms")
    assert worst < 1.0, f"a coordinator call took {worst:.2f} s during the stall"
    assert all(s.epoch == before.epoch and _all_healthy(s) for s in during)
    records = b.results(120)
    assert [r.error for r in records] == [None] * 4
    assert [r.text for r in records] == reference
    after = serve.status()
    assert after.epoch == before.epoch and after.pids() == before.pids()
    assert _all_healthy(after)
    assert serve.coordinator_pid() == coordinator
    assert _silence_lines(serve) == silences, "a rank saw its coordinator silent"


def test_ctrl_c_ends_open_streams_with_an_error_event(serve):
    """Runs last: it stops the module's deployment, its coordinator process included."""
    coordinator = serve.coordinator_pid()
    assert coordinator is not None
    b = burst(serve, PROMPTS[:3], 900)  # far longer than the 5 s grace on 2 cores
    assert b.wait_tokens(3 * 4, 60), f"only {b.tokens()} tokens arrived"
    assert serve.interrupt(timeout_s=60) == 130
    assert not pid_alive(coordinator), "the coordinator outlived serve's Ctrl-C"
    records = b.results(30)
    assert all(r.error is not None and "the server is shutting down" in r.error
               for r in records), [r.error for r in records]
    assert all(4 <= len(r.token_times) < 900 for r in records)
