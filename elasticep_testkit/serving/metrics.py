"""The summary of one serving benchmark run, as SGLang's ``bench_serving`` reports it
(pure functions over per-request timings; every time in seconds, reported in ms).

- A token event: an SSE message whose JSON has a non-empty ``choices`` list.
- TTFT: request sent -> first token event.
- ITL: every gap between two consecutive token events of one request.
- E2E: request sent -> the last SSE message of the stream (``data: [DONE]`` included),
  as bench_serving's ``latency``.
- TPOT: per request ``(E2E - TTFT) / (output tokens - 1)``, requests with more than one
  output token only; output tokens are the server's ``usage.completion_tokens``.
- ``concurrency``: the sum of E2E over the duration (how many requests were in flight
  on average), as bench_serving computes it.

One difference from bench_serving, also written into each JSON line
(:data:`DIFFERENCES_FROM_SGLANG`): bench_serving counts only chunks with non-empty text
as token events; here every chunk with a choice counts, empty text included, because
this server sends exactly one chunk per generated token and leaves the text empty while
a UTF-8 character or a possible stop string is incomplete (skipping those chunks would
merge two ITL gaps into one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

DIFFERENCES_FROM_SGLANG = (
    "token events: every SSE chunk with a choice counts, empty text included (this server "
    "sends one chunk per token); bench_serving skips chunks with empty text",
)


@dataclass
class RequestResult:
    """One request's timings and counts.

    Attributes:
        prompt_len: prompt tokens (the server's usage where it sent one, else ours).
        output_tokens: generated tokens (the server's usage, else one per token event).
        start: when it was sent (``time.perf_counter()`` seconds).
        ttft: seconds to the first token event; None if none came.
        itl: seconds between consecutive token events.
        e2e: seconds from ``start`` to the last message of the stream.
        error: why it failed, or None.
    """

    prompt_len: int
    output_tokens: int = 0
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str | None = None

    @classmethod
    def from_events(cls, prompt_len: int, start: float,
                    messages: list[tuple[float, bool]]) -> RequestResult:
        """A request's timings from its stream's messages (no counts: the caller sets
        ``output_tokens`` from the server's usage, or from the token events).

        Args:
            prompt_len: prompt tokens.
            start: when the request was sent, seconds.
            messages: ``(arrival time in seconds, is a token event)`` of every SSE
                message of the stream, in arrival order (``[DONE]`` included, as not a
                token event).

        Returns:
            ttft (None without a token event), itl (gaps between consecutive token
            events) and e2e (``start`` -> the last message; 0 without one), each in
            seconds.
        """
        token_times = [t for t, is_token in messages if is_token]
        res = cls(prompt_len=prompt_len, start=start)
        if token_times:
            res.ttft = token_times[0] - start
            res.itl = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
        if messages:
            res.e2e = messages[-1][0] - start
        return res

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None with fewer than two tokens."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``p99_<name>_ms`` (None when empty)."""
    if not values_s:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "p99")}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {f"mean_{name}_ms": round(float(ms.mean()), 3),
            f"median_{name}_ms": round(float(np.median(ms)), 3),
            f"p99_{name}_ms": round(float(np.percentile(ms, 99)), 3)}


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """The JSON fields of a run.

    Args:
        results: every request, failed ones included (they count as ``errors`` and
            nowhere else).
        duration_s: first request sent -> last request ended, seconds.

    Returns:
        completed, errors, duration_s, request_throughput (req/s), input_throughput and
        output_throughput (tok/s), total_input_tokens, total_output_tokens, concurrency,
        and mean/median/p99 of TTFT, TPOT, ITL and E2E in ms.

    Raises:
        ValueError: ``duration_s`` is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.error is None]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "completed": len(ok), "errors": len(results) - len(ok),
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(ok) / duration_s, 3),
        "input_throughput": round(total_in / duration_s, 1),
        "output_throughput": round(total_out / duration_s, 1),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "concurrency": round(sum(r.e2e for r in ok) / duration_s, 2),
    }
    out.update(_stats("ttft", [r.ttft for r in ok if r.ttft is not None]))
    out.update(_stats("tpot", [t for r in ok if (t := r.tpot) is not None]))
    out.update(_stats("itl", [x for r in ok for x in r.itl]))
    out.update(_stats("e2e_latency", [r.e2e for r in ok]))
    return out


def first_errors(results: list[RequestResult], n: int = 3) -> list[str]:
    """Up to ``n`` distinct error messages, for the JSON line."""
    return list(dict.fromkeys(r.error for r in results if r.error))[:n]
