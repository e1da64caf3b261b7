"""Helpers of the `elasticep serve` end-to-end tests: one real deployment per module.

The deployment is the real command in a subprocess on free loopback ports; clients are
the real `openai` package. Only pids this harness started (serve, join) or read from
``/elastic_ep_status`` are ever signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from elasticep.utils.procs import kill_pids, pid_alive
from elasticep_testkit.harness.serve_process import cli_command as cli
from elasticep_testkit.harness.serve_process import free_port
from elasticep_testkit.prompts import gsm8k_questions

ROOT = Path(__file__).resolve().parents[1]


def prompts(n: int, chars: int = 110) -> list[str]:
    """The first ``n`` GSM8K questions of the bundled sample, cut to ``chars`` characters
    so each prompt is about 25 tokens (a 2-core budget)."""
    return gsm8k_questions(n, chars)


# The burst the failover and scale modules stream through one deployment: 8 concurrent
# greedy streams of 24 tokens each (a 2-core budget).
N_STREAMS = 8
MAX_TOKENS = 24
PROMPTS = prompts(N_STREAMS)


@dataclass
class StreamResult:
    text: str = ""
    chunks: int = 0
    max_gap_s: float = 0.0
    error: str | None = None


@dataclass
class Serve:
    """One `elasticep serve` subprocess and what the test learned about it."""

    proc: subprocess.Popen
    url: str
    coordinator: str
    log_path: Path
    seen_pids: set[int] = field(default_factory=set)
    joins: list[subprocess.Popen] = field(default_factory=list)

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             timeout=60)

    def status(self) -> dict:
        body = httpx.get(f"{self.url}/elastic_ep_status", timeout=10).json()
        self.seen_pids |= {r["pid"] for r in body["ranks"] if r["pid"]}
        return body

    def rank(self, rank: int) -> dict:
        return next(r for r in self.status()["ranks"] if r["rank"] == rank)

    def wait_for(self, pred, timeout_s: float, what: str, poll_s: float = 0.05,
                 watch: tuple[subprocess.Popen, ...] = ()) -> dict:
        """Poll the status until ``pred(status)``; returns it.

        Args:
            watch: `join` processes that must stay alive meanwhile.

        Raises:
            AssertionError: timeout, or serve or a watched `join` exited meanwhile.
        """
        deadline = time.monotonic() + timeout_s
        live_joins = [j for j in watch if j.poll() is None]
        while True:
            st = self.status()
            if pred(st):
                return st
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {st}"
            assert self.proc.poll() is None, f"serve exited: {self.tail()}"
            for j in live_joins:
                assert j.poll() is None, f"join exited with {j.returncode}: {self.join_log(j)}"
            time.sleep(poll_s)

    def join_log(self, join: subprocess.Popen) -> str:
        path = self.log_path.with_suffix(f".join{self.joins.index(join)}.log")
        return path.read_text()[-3000:]

    def join(self, *args: str) -> subprocess.Popen:
        """Start ``elasticep join --dist-init-addr <coordinator> ARGS``; once serve is
        gone, it tries the coordinator for 5 s (``--coordinator-timeout``), then exits."""
        log = open(self.log_path.with_suffix(f".join{len(self.joins)}.log"), "w")  # noqa: SIM115
        p = subprocess.Popen(cli("join", "--dist-init-addr", self.coordinator,
                                 "--coordinator-timeout", "5", *args),
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.joins.append(p)
        return p

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text()[-n:]

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT serve (as Ctrl-C would) and wait; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        return self.proc.poll()

    def cleanup(self) -> None:
        """Last resort after a failed test: kill only what we started or saw."""
        pids = [p.pid for p in [self.proc, *self.joins] if p.poll() is None]
        kill_pids(pids + [p for p in self.seen_pids if pid_alive(p)], timeout_s=5)
        for p in [self.proc, *self.joins]:
            if p.poll() is None:
                p.kill()
            p.wait(5)


def start_serve(*args: str, coord: str | None = None, timeout_s: float = 180.0) -> Serve:
    """Start ``elasticep serve --port P --dist-init-addr COORD ARGS``; wait for the ready
    line on stdout.

    Args:
        coord: the coordinator's ``host:port`` (default: a free loopback port).

    Raises:
        AssertionError: serve exited or printed no ready line in ``timeout_s`` seconds.
    """
    port, coord = free_port(), coord or f"127.0.0.1:{free_port()}"
    log_path = Path(tempfile.mkdtemp(prefix="elasticep-serve-")) / "serve.log"
    stderr = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen(cli("serve", "--port", str(port), "--dist-init-addr", coord, *args),
                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    serve = Serve(proc, f"http://127.0.0.1:{port}", coord, log_path)
    deadline = time.monotonic() + timeout_s
    while not any(line.startswith("ready") for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            serve.cleanup()
            raise AssertionError(f"serve did not become ready: {serve.tail()}")
        time.sleep(0.1)
    serve.status()
    return serve


def serve_fixture(*args: str):
    """A module-scoped ``serve`` fixture: one ``start_serve(*args)`` deployment shared by
    every test of the module, cleaned up (:meth:`Serve.cleanup`) after the last one.

    Use as ``serve = serve_fixture("--ep-size", "4", ...)`` at module level.
    """

    @pytest.fixture(scope="module", name="serve")
    def _serve():
        s = start_serve(*args)
        yield s
        s.cleanup()

    return _serve


def stream(client: openai.OpenAI, prompt: str, max_tokens: int,
           on_token=None) -> StreamResult:
    """One greedy streaming completion; records text, chunk count and longest gap."""
    out = StreamResult()
    last = time.monotonic()
    try:
        for chunk in client.completions.create(model=client_model(client), prompt=prompt,
                                               max_tokens=max_tokens, temperature=0,
                                               stream=True):
            now = time.monotonic()
            out.max_gap_s = max(out.max_gap_s, now - last)
            last = now
            out.text += chunk.choices[0].text
            out.chunks += 1
            if on_token is not None:
                on_token()
    except openai.OpenAIError as exc:
        out.error = repr(exc)
    return out


_MODEL_NAMES: dict[str, str] = {}


def client_model(client: openai.OpenAI) -> str:
    """The served model name (cached per base URL)."""
    key = str(client.base_url)
    if key not in _MODEL_NAMES:
        _MODEL_NAMES[key] = client.models.list().data[0].id
    return _MODEL_NAMES[key]


class Burst:
    """Run many streams concurrently; ``tokens`` counts chunks received so far."""

    def __init__(self, client: openai.OpenAI, texts: list[str], max_tokens: int) -> None:
        self.tokens = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(len(texts))
        self._futures = [self._pool.submit(stream, client, t, max_tokens, self._tick)
                         for t in texts]

    def _tick(self) -> None:
        with self._lock:
            self.tokens += 1

    def wait_tokens(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tokens < n:
            assert time.monotonic() < deadline, f"only {self.tokens} tokens arrived"
            assert not all(f.done() for f in self._futures), "every stream already ended"
            time.sleep(0.01)

    def results(self, timeout_s: float = 120.0) -> list[StreamResult]:
        out = [f.result(timeout=timeout_s) for f in self._futures]
        self._pool.shutdown()
        return out


def signal_pid(pid: int, sig: int) -> None:
    """Signal one rank's worker pid (read from /elastic_ep_status)."""
    os.kill(pid, sig)


def reference_results(serve: Serve, texts: list[str], max_tokens: int) -> list[StreamResult]:
    """One fault-free burst of greedy streams; every stream must succeed."""
    results = Burst(serve.client, texts, max_tokens).results()
    assert [r.error for r in results] == [None] * len(texts)
    return results


def fault_midstream(serve: Serve, texts: list[str], max_tokens: int, reference: list[str],
                    pid: int, sig: int) -> None:
    """Run one stream per text and send ``sig`` to worker ``pid`` once they are partway
    (4 tokens per stream); every stream must still succeed with its ``reference`` text."""
    burst = Burst(serve.client, texts, max_tokens)
    burst.wait_tokens(len(texts) * 4)
    signal_pid(pid, sig)
    results = burst.results()
    assert [r.error for r in results] == [None] * len(texts)
    assert [r.text for r in results] == reference
