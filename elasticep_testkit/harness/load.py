"""Greedy streaming load through the real `openai` client, every token timestamped.

Two shapes:

* :class:`SteadyLoad` keeps ``concurrency`` streams busy, each thread starting its next
  request as soon as the previous one ends, until :meth:`SteadyLoad.stop`;
* :func:`run_batch` sends a fixed list of prompts at once and waits for them all.

Requests use ``temperature=0`` and ``ignore_eos=True``, so a complete answer always has
exactly ``max_tokens`` tokens: a shorter stream without an error is a silent loss.
Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import openai

from elasticep.utils.wait import wait_until


@dataclass
class RequestRecord:
    """One streamed completion.

    Attributes:
        prompt_idx: index into the prompt list.
        start: when the request was sent (monotonic seconds).
        token_times: arrival time of every streamed chunk (one chunk per token).
        text: the concatenated text.
        finish_reason: the last chunk's finish reason (None if the stream broke).
        error: ``repr`` of the client error, or None.
        end: when the stream ended (monotonic seconds).
    """

    prompt_idx: int
    start: float
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    end: float = 0.0

    def complete(self, max_tokens: int) -> bool:
        """True for a full answer: no error, ``max_tokens`` tokens, finish ``length``."""
        return (self.error is None and len(self.token_times) == max_tokens
                and self.finish_reason == "length")


def make_client(url: str, timeout_s: float) -> openai.OpenAI:
    """An OpenAI client for ``url`` with no retries (a retry would hide a failure) and a
    per-request ``timeout_s`` (a hang becomes an error, never a stuck thread)."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                         timeout=timeout_s)


def stream_into(rec: RequestRecord, client: openai.OpenAI, model: str, prompt: str,
                max_tokens: int) -> RequestRecord:
    """Send one greedy streaming completion, filling ``rec`` as tokens arrive (so other
    threads see progress); errors are recorded, never raised. Returns ``rec``."""
    rec.start = time.monotonic()
    try:
        for chunk in client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True}):
            choice = chunk.choices[0] if chunk.choices else None
            if choice is None:
                continue  # a usage-only chunk
            if choice.text or choice.finish_reason is None:
                rec.text += choice.text
                rec.token_times.append(time.monotonic())
            if choice.finish_reason is not None:
                rec.finish_reason = choice.finish_reason
    except (openai.OpenAIError, OSError) as exc:
        rec.error = repr(exc)
    rec.end = time.monotonic()
    return rec


class Batch:
    """Send every prompt at once, one thread each; watch progress, then collect.

    Args:
        client: from :func:`make_client` (its timeout bounds every request).
        model: served model id.
        prompts: one request per prompt (``records[i]`` is ``prompts[i]``).
        max_tokens: tokens per request.
    """

    def __init__(self, client: openai.OpenAI, model: str, prompts: list[str],
                 max_tokens: int) -> None:
        now = time.monotonic()
        self.records = [RequestRecord(i, now) for i in range(len(prompts))]
        self._pool = ThreadPoolExecutor(len(prompts), thread_name_prefix="batch")
        self._futures = [self._pool.submit(stream_into, rec, client, model, p, max_tokens)
                         for rec, p in zip(self.records, prompts, strict=True)]

    def tokens(self) -> int:
        """Tokens streamed so far, over every request."""
        return sum(len(r.token_times) for r in self.records)

    def wait_tokens(self, n: int, timeout_s: float) -> bool:
        """Wait until ``n`` tokens arrived; False if every request ended first or
        ``timeout_s`` seconds passed."""
        try:
            wait_until(lambda: self.tokens() >= n or all(f.done() for f in self._futures),
                       timeout_s, f"{n} tokens", poll_s=0.01)
        except TimeoutError:
            return False
        return self.tokens() >= n

    def results(self, timeout_s: float) -> list[RequestRecord]:
        """Wait for every request (prompt order).

        Raises:
            TimeoutError: some request still ran after ``timeout_s`` seconds (a hang).
        """
        deadline = time.monotonic() + timeout_s
        try:
            for f in self._futures:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise TimeoutError(f"{sum(not f.done() for f in self._futures)} of "
                               f"{len(self._futures)} requests still running after "
                               f"{timeout_s:.0f}s") from None
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
        return self.records


def run_batch(client: openai.OpenAI, model: str, prompts: list[str], max_tokens: int,
              timeout_s: float) -> list[RequestRecord]:
    """:class:`Batch` of ``prompts``, waited for (raises TimeoutError like it)."""
    return Batch(client, model, prompts, max_tokens).results(timeout_s)


class SteadyLoad:
    """``concurrency`` threads, each streaming one request after another over the
    prompts (round robin), until :meth:`stop`.

    Args:
        client: from :func:`make_client` (its timeout bounds every request).
        model: served model id.
        prompts: prompt texts; request ``i`` uses ``prompts[i % len(prompts)]``.
        concurrency: number of streams kept in flight.
        max_tokens: tokens per request.
    """

    def __init__(self, client: openai.OpenAI, model: str, prompts: list[str],
                 concurrency: int, max_tokens: int) -> None:
        self.records: list[RequestRecord] = []
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._counter = itertools.count()
        self._args = (client, model, prompts)
        self._threads = [threading.Thread(target=self._run, name=f"load-{i}", daemon=True)
                         for i in range(concurrency)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        client, model, prompts = self._args
        while not self._stop.is_set():
            with self._lock:
                i = next(self._counter) % len(prompts)
            rec = RequestRecord(i, time.monotonic())
            with self._lock:
                self.records.append(rec)
            stream_into(rec, client, model, prompts[i], self.max_tokens)

    def tokens_received(self) -> int:
        """Tokens streamed so far, over every request."""
        with self._lock:
            return sum(len(r.token_times) for r in self.records)

    def stop(self, timeout_s: float) -> list[RequestRecord]:
        """Let every in-flight request finish (start no new one); return all records.

        Raises:
            TimeoutError: a request was still running after ``timeout_s`` seconds.
        """
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            raise TimeoutError(f"{len(stuck)} streams still running {timeout_s:.0f}s after "
                               f"stop: {stuck}")
        return sorted(self.records, key=lambda r: r.start)


@dataclass(frozen=True)
class Outcomes:
    """How a set of requests ended, against fault-free reference texts.

    Attributes:
        total: requests counted.
        completed: full answers (``max_tokens`` tokens, no error).
        errors: requests that got a client-visible error (``repr`` each).
        silent_losses: streams that ended without an error but short of ``max_tokens``.
        mismatched: prompt indices of complete answers whose text differs from the
            reference.
    """

    total: int
    completed: int
    errors: tuple[str, ...]
    silent_losses: int
    mismatched: tuple[int, ...]

    @property
    def outputs_identical(self) -> bool:
        return not self.mismatched


def outcomes(records: list[RequestRecord], reference: dict[int, str],
             max_tokens: int) -> Outcomes:
    """Classify ``records`` (see :class:`Outcomes`); prompts without a reference text
    are not compared."""
    done = [r for r in records if r.complete(max_tokens)]
    errors = tuple(r.error for r in records if r.error is not None)
    silent = sum(r.error is None and not r.complete(max_tokens) for r in records)
    mismatched = tuple(r.prompt_idx for r in done
                       if r.prompt_idx in reference and r.text != reference[r.prompt_idx])
    return Outcomes(len(records), len(done), errors, silent, mismatched)
