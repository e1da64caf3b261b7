"""Stub ranks for measuring the front-end alone: no model, tokens at a set rate.

A :class:`StubEngine` steps ``steps_per_s`` times a second while it has requests and
emits one token per running request per step (the request's prompt ids, cycled, so
detokenization works on real text), never EOS, until each request's ``max_tokens``.
It is driven by the real rank loop (:func:`~elasticep.elastic.serve_loop.run_engine_worker`)
over the real zmq transport, so each step's tokens reach the front-end as one message,
as a real rank sends them. :func:`rank_main` is one such rank process; the server
program is ``python -m elasticep_testkit.serving.stub_serve``.

Each rank writes ``stub_rank<r>.json`` in the log dir (tokens, steps, seconds busy,
steps that started late, requests running) at start, whenever its last request
finishes or is aborted and every second while busy; :func:`read_stats` sums them and :func:`report` turns two readings
into the benchmark's ``stub`` fields.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticep.elastic.serve_loop import run_engine_worker
from elasticep.engine.request import GenerateRequest, TokenOutput
from elasticep.frontend_link import LinkEndpoints
from elasticep.frontend_link.fanout import worker_link
from elasticep.utils.procs import die_with_parent
from elasticep_testkit.serving.running_table import RunningTable

STATS_EVERY_S = 1.0


@dataclass
class _Running:
    request: GenerateRequest
    emitted: int


class StubEngine(RunningTable):
    """A :class:`~elasticep.elastic.serve_loop.StepEngine` that paces its steps.

    Args:
        steps_per_s: steps per second while busy (> 0).
        stats_path: where to write the counters (None: nowhere).
        clock, sleep: injected for tests (``time.monotonic`` / ``time.sleep``).

    Raises:
        ValueError: ``steps_per_s`` is not positive.
    """

    def __init__(self, steps_per_s: float, stats_path: Path | None = None,
                 clock=time.monotonic, sleep=time.sleep) -> None:
        if not steps_per_s > 0:
            raise ValueError(f"steps_per_s must be > 0, got {steps_per_s}")
        self.period = 1.0 / steps_per_s
        self.stats_path = stats_path
        self._clock, self._sleep = clock, sleep
        self.running: dict[str, _Running] = {}
        self._next: float | None = None  # when the next step is due
        self.tokens = self.steps = self.late_steps = 0
        self.busy_s = 0.0  # wall seconds spent with requests: one period per step
        self._last_wall: float | None = None  # of the last step of this busy period
        self._written = 0.0

    def add_request(self, req: GenerateRequest) -> None:
        """Start emitting for ``req`` (a resumed one continues at its index)."""
        self.running[req.request_id] = _Running(req, len(req.output_token_ids))

    def abort(self, request_id: str) -> bool:
        """Drop a request; True if it was running. Writes the counters when that
        leaves none running (no step follows to write them)."""
        found = super().abort(request_id)
        if found and not self.running:
            self.write_stats()
        return found

    def step(self) -> list[TokenOutput]:
        """Wait for the next tick, then one token per running request.

        A step that starts more than one period late (the loop was held up, e.g. by a
        full output queue) counts in ``late_steps``; the schedule then restarts from
        now instead of bursting to catch up.
        """
        now = self._clock()
        from_idle = self._next is None
        if self._next is None or now - self._next > self.period:
            if self._next is not None:
                self.late_steps += 1
            self._next = now
        elif self._next > now:
            self._sleep(self._next - now)
        self._next += self.period
        out = []
        for rid, run in list(self.running.items()):
            req = run.request
            prompt = req.prompt_token_ids
            token = prompt[run.emitted % len(prompt)]
            run.emitted += 1
            done = run.emitted >= req.params.max_tokens
            out.append(TokenOutput(rid, run.emitted - 1, token, "length" if done else None))
            if done:
                del self.running[rid]
        self.steps += 1
        self.tokens += len(out)
        wall = time.time()
        # a busy period lasts from one period before its first step to its last step
        self.busy_s += self.period if from_idle else wall - self._last_wall
        self._last_wall = wall
        if not self.running:
            self._next = None  # idle: the next request starts a fresh schedule
        if not self.running or wall - self._written >= STATS_EVERY_S:
            self.write_stats()
        return out

    def stats(self) -> dict[str, Any]:
        """The counters: tokens, steps, late_steps, busy_s (seconds with requests), and
        running (requests running now)."""
        return {"tokens": self.tokens, "steps": self.steps, "late_steps": self.late_steps,
                "busy_s": round(self.busy_s, 6), "period_s": self.period,
                "running": len(self.running)}

    def write_stats(self) -> None:
        """Replace ``stats_path`` with :meth:`stats` (atomically)."""
        self._written = time.time()
        if self.stats_path is None:
            return
        tmp = self.stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stats()))
        os.replace(tmp, self.stats_path)


def stats_path(log_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its counters."""
    return Path(log_dir) / f"stub_rank{rank}.json"


def rank_main(rank: int, endpoints: Sequence[LinkEndpoints], steps_per_s: float,
              log_dir: str, parent_pid: int) -> None:
    """One stub rank process: serve a :class:`StubEngine` until SIGTERM or the parent's
    exit (it dies with the server process), linked to every front-end process of
    ``endpoints`` (the first is the server's own), as a real rank is."""
    die_with_parent(parent_pid)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops us, not the terminal
    engine = StubEngine(steps_per_s, stats_path(Path(log_dir), rank))
    engine.write_stats()  # a rank that never gets a request still reports
    channel = worker_link(endpoints[0], rank, "embedded", extra=endpoints[1:])
    try:
        run_engine_worker(engine, channel, rank, stop)
    finally:
        engine.write_stats()
        channel.close()


def server_command(steps_per_s: float) -> tuple[str, ...]:
    """The stub server's command line up to its flags (for ``ServeProcess.start``)."""
    return (sys.executable, "-m", "elasticep_testkit.serving.stub_serve",
            "--stub-engine-steps-per-s", repr(steps_per_s))


def read_stats(log_dir: Path, ranks: int, timeout_s: float = 5.0) -> dict[str, float]:
    """Every rank's counters, summed (``busy_s``: the longest rank's), once all
    ``ranks`` files show an idle rank.

    A rank writes its file at start and, inside the step that finishes its last
    request, before that step's tokens are sent: read between runs (no request in
    flight), the files are exact.

    Raises:
        TimeoutError: fewer than ``ranks`` files after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(Path(log_dir).glob("stub_rank*.json"))
        if len(files) >= ranks:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(files)} of {ranks} stub rank stats in {log_dir}")
        time.sleep(0.1)
    stats = [json.loads(f.read_text()) for f in files]
    return {"tokens": sum(s["tokens"] for s in stats), "steps": sum(s["steps"] for s in stats),
            "late_steps": sum(s["late_steps"] for s in stats),
            "busy_s": max(s["busy_s"] for s in stats)}


def report(before: dict[str, float], after: dict[str, float], steps_per_s: float,
           max_concurrency: int, served_tokens: int, duration_s: float) -> dict[str, Any]:
    """The ``stub`` fields of the benchmark's JSON over one run (counters ``before`` and
    ``after`` it, from :func:`read_stats`).

    ``nominal_tok_s`` is what the stub emits with ``max_concurrency`` requests running
    (one token each per step); ``emitted_tok_s`` what it emitted over its busy time;
    ``served_over_nominal`` what the client received per second against the nominal
    rate: a front-end that keeps up, with every stream running, gives 1.
    """
    tokens = after["tokens"] - before["tokens"]
    busy = after["busy_s"] - before["busy_s"]
    nominal = steps_per_s * max_concurrency
    served = served_tokens / duration_s
    return {"steps_per_s": steps_per_s, "emitted_tokens": int(tokens),
            "steps": int(after["steps"] - before["steps"]),
            "late_steps": int(after["late_steps"] - before["late_steps"]),
            "emitted_tok_s": round(tokens / busy, 1) if busy > 0 else None,
            "nominal_tok_s": round(nominal, 1),
            "served_over_nominal": round(served / nominal, 3)}
