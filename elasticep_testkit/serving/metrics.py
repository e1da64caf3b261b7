"""The summary of one serving benchmark run, as SGLang's ``bench_serving`` reports it
(pure functions over per-request timings; every time in seconds, reported in ms).

- TTFT: request sent -> first token event.
- TPOT: per request ``(E2E - TTFT) / (output tokens - 1)``, requests with more than one
  output token only.
- ITL: every gap between two token events of one request.
- E2E: request sent -> last event.
- ``concurrency``: the sum of E2E over the duration (how many requests were in flight
  on average), as bench_serving computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    """One request's timings and counts.

    Attributes:
        prompt_len: prompt tokens (the server's usage where it sent one, else ours).
        output_tokens: generated tokens (the server's usage, else one per token event).
        start: when it was sent (``time.perf_counter()`` seconds).
        ttft: seconds to the first token event; None if none came.
        itl: seconds between consecutive token events.
        e2e: seconds from ``start`` to the last event.
        error: why it failed, or None.
    """

    prompt_len: int
    output_tokens: int = 0
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str | None = None

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
