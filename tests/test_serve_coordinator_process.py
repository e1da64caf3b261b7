"""`elasticep serve` runs its coordinator as a child process (issue 30 item 2); these
cases end the deployment, so each starts its own.

- The coordinator process dies: serve says so on stderr, ends open streams with an
  error event, stops every rank and exits 1, within seconds (never a hang).
- serve is SIGKILLed: its coordinator and its ranks do not outlive it.

The stall of serve's front-end (SIGSTOP for 1, 5 and 20 s) is in
test_serve_containment.py. Only pids of the deployment this test started are signalled.
"""

from __future__ import annotations

import os
import signal

import pytest
from _serve_fixtures import MAX_TOKENS, PROMPTS, burst, start_serve

from elasticep.utils.procs import pid_alive
from elasticep.utils.wait import wait_until

pytestmark = pytest.mark.timeout(300)


def test_a_dead_coordinator_stops_serve_with_an_error():
    with start_serve("--ep-size", "2") as serve:
        coordinator = serve.coordinator_pid()
        assert coordinator not in (None, serve.proc.pid)
        b = burst(serve, PROMPTS[:2], MAX_TOKENS)
        assert b.wait_tokens(2 * 2, 60), f"only {b.tokens()} tokens arrived"
        ours = serve.note_descendants()  # the workers, before serve may reap them
        os.kill(coordinator, signal.SIGKILL)
        assert serve.proc.wait(60) == 1
        log = serve.tail(1 << 20)
        assert (f"the coordinator process (pid {coordinator}) was killed by signal 9"
                in log), log[-3000:]
        records = b.results(30)  # every stream ended: with an error or complete
        assert all(r.error is not None or r.complete(MAX_TOKENS) for r in records), \
            [(r.error, r.finish_reason) for r in records]
        wait_until(lambda: not any(pid_alive(p) for p in ours), 15,
                   "serve's ranks to exit after it stopped")


def test_a_killed_serve_leaves_no_coordinator_and_no_rank():
    with start_serve("--ep-size", "1") as serve:
        coordinator = serve.coordinator_pid()
        ours = serve.note_descendants()
        assert coordinator in ours and len(ours) >= 2  # the coordinator and rank 0
        serve.proc.kill()
        serve.proc.wait(10)
        wait_until(lambda: not any(pid_alive(p) for p in ours), 20,
                   "the coordinator and the rank to exit with serve")
