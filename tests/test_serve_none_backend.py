"""`elasticep serve --elastic-ep-backend none` end to end: no fault tolerance, so the
first rank death stops the whole deployment cleanly.

One EP2 deployment of the demo model: a request works; then, with streams in flight,
rank 1's worker is SIGKILLed. Serve must log one line with the reason, answer the
in-flight and new requests with errors (no hang), stop its other worker and exit 1.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from _serve_fixtures import MAX_TOKENS, PROMPTS, burst, start_serve, stream

from elasticep.utils.procs import pid_alive
from elasticep.utils.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def test_rank_death_stops_the_deployment():
    serve = start_serve("--ep-size", "2", "--elastic-ep-backend", "none",
                        "--max-total-tokens", "2048")
    try:
        st = serve.status()
        assert [r.state for r in st.ranks] == ["healthy", "healthy"], st
        pids = st.pids()
        assert sorted(pids) == [0, 1], st
        ok = stream(serve, PROMPTS[0], 8)
        assert ok.complete(8), ok

        b = burst(serve, PROMPTS[:4], MAX_TOKENS)
        assert b.wait_tokens(4, 60), f"only {b.tokens()} tokens arrived"
        os.kill(pids[1], signal.SIGKILL)
        # A new request while the deployment goes away: an error answer, never a hang.
        t0 = time.monotonic()
        try:
            late = httpx.post(f"{serve.url}/v1/completions", timeout=30, json={
                "model": serve.model_name(), "prompt": PROMPTS[1], "max_tokens": 8})
            assert late.status_code >= 500, (late.status_code, late.text)
        except httpx.TransportError:
            pass  # the server had already closed: refused is an error answer too
        assert time.monotonic() - t0 < 25

        code = serve.proc.wait(30)
        assert code == 1, serve.tail()
        results = b.results(timeout_s=10)
        assert all(r.error is not None for r in results), results

        log = serve.log_path.read_text()
        line = (rf"rank 1 \(pid {pids[1]}\) exited with -9; --elastic-ep-backend none has no "
                r"fault tolerance: stopping the deployment")
        assert len(re.findall(line, log)) == 1, log[-4000:]
        assert "join --elastic-ep-join-mode" not in log, log[-4000:]
        wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 10,
                   "every worker to exit", poll_s=0.1,
                   last=lambda: [p for p in pids.values() if pid_alive(p)])
    finally:
        serve.stop()
