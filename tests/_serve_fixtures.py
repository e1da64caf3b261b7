"""What the `elasticep serve` end-to-end tests share on top of the testkit's serve driver
(`elasticep_testkit.harness`: the serve and join processes, the typed status, the
streaming load): the module-scoped deployment, the prompt burst, and the checks that
several modules repeat.
"""

from __future__ import annotations

import os

import pytest

from elasticep_testkit.harness.load import Batch, RequestRecord, run_batch
from elasticep_testkit.harness.serve_process import ServeProcess
from elasticep_testkit.prompts import gsm8k_questions

READY_TIMEOUT_S = 180.0  # model load on every rank of a 2-core machine
RESULTS_TIMEOUT_S = 120.0  # a burst still streaming after this is a hang
JOIN_COORDINATOR_TIMEOUT_S = 5.0  # a join whose serve is gone exits after this


def prompts(n: int, chars: int = 110) -> list[str]:
    """The first ``n`` GSM8K questions of the bundled sample, cut to ``chars`` characters
    so each prompt is about 25 tokens (a 2-core budget)."""
    return gsm8k_questions(n, chars)


# The burst the failover and scale modules stream through one deployment: 8 concurrent
# greedy streams of 24 tokens each (a 2-core budget).
N_STREAMS = 8
MAX_TOKENS = 24
PROMPTS = prompts(N_STREAMS)


def start_serve(*args: str, coordinator: str | None = None) -> ServeProcess:
    """``elasticep serve ARGS`` on free loopback ports, ready (every rank healthy)."""
    return ServeProcess.start(list(args), ready_timeout_s=READY_TIMEOUT_S,
                              coordinator=coordinator)


def etcd_two_node_args(url: str, hb_timeout_s: float) -> tuple[str, ...]:
    """The serve flags every node of a 2-node, 4-rank deployment with its membership in
    etcd at ``url`` shares (it survives the loss of one node's ranks)."""
    return ("--ep-size", "4", "--nnodes", "2", "--min-ep-size", "2",
            "--heartbeat-timeout", str(hb_timeout_s), "--coordinator-timeout", "20",
            "--membership-store", url)


def serve_fixture(*args: str):
    """A module-scoped ``serve`` fixture: one ``start_serve(*args)`` deployment shared by
    every test of the module, stopped (:meth:`ServeProcess.stop`) after the last one.

    Use as ``serve = serve_fixture("--ep-size", "4", ...)`` at module level.
    """

    @pytest.fixture(scope="module", name="serve")
    def _serve():
        with start_serve(*args) as s:
            yield s

    return _serve


def burst(serve: ServeProcess, texts: list[str], max_tokens: int) -> Batch:
    """One greedy stream per text, all at once (``ignore_eos``: exactly ``max_tokens``)."""
    return Batch(serve.client, serve.model_name(), texts, max_tokens)


def stream(serve: ServeProcess, prompt: str, max_tokens: int) -> RequestRecord:
    """One greedy streaming completion, waited for."""
    return run_batch(serve.client, serve.model_name(), [prompt], max_tokens,
                     RESULTS_TIMEOUT_S)[0]


def assert_complete(records: list[RequestRecord], max_tokens: int) -> None:
    """Every request ended without an error and with all ``max_tokens`` tokens."""
    assert [r.error for r in records] == [None] * len(records)
    assert [len(r.token_times) for r in records] == [max_tokens] * len(records)
    assert all(r.complete(max_tokens) for r in records), [r.finish_reason for r in records]


def reference_results(serve: ServeProcess, texts: list[str], max_tokens: int) -> list[str]:
    """The texts of one fault-free burst; every stream must be complete."""
    records = burst(serve, texts, max_tokens).results(RESULTS_TIMEOUT_S)
    assert_complete(records, max_tokens)
    return [r.text for r in records]


def fault_midstream(serve: ServeProcess, texts: list[str], max_tokens: int,
                    reference: list[str], pid: int, sig: int) -> None:
    """Run one stream per text and send ``sig`` to worker ``pid`` once they are partway
    (4 tokens per stream); every stream must still be complete, with its ``reference``
    text."""
    b = burst(serve, texts, max_tokens)
    assert b.wait_tokens(len(texts) * 4, 60), f"only {b.tokens()} tokens arrived"
    os.kill(pid, sig)
    records = b.results(RESULTS_TIMEOUT_S)
    assert_complete(records, max_tokens)
    assert [r.text for r in records] == reference
