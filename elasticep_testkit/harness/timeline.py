"""Pure statistics over token timestamps, and the tokens/s timeline plot.

Every time is ``time.monotonic()`` seconds; windows are half-open ``[t0, t1)``. A *gap*
is the time between two consecutive tokens of one request (time to first token is not
a gap: it includes the prompt's prefill); a *wait* is a gap or, for a request in flight
at an event with no token yet, its time to first token.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from elasticep_testkit.harness.load import RequestRecord

Event = tuple[float, str]


def gaps(records: Iterable[RequestRecord]) -> list[tuple[float, float]]:
    """Every (start, end) between consecutive tokens of the same request."""
    out = []
    for r in records:
        out.extend(zip(r.token_times, r.token_times[1:], strict=False))
    return out


def max_gap_overlapping(records: Iterable[RequestRecord], t0: float, t1: float) -> float:
    """Longest gap that overlaps ``[t0, t1]``; 0.0 if none does."""
    return max((b - a for a, b in gaps(records) if a < t1 and b > t0), default=0.0)


def max_wait_across(records: list[RequestRecord], t_event: float, t1: float) -> float:
    """The interruption across an event: the longest a client waited for its next
    token, over gaps that overlap ``[t_event, t1]`` and the time to first token of every
    request in flight at ``t_event`` that had no token yet (a request sent to a rank
    that then died waits for its first token, not between two). A request that never
    got a token waited until it ended. 0.0 if nothing overlaps.

    Args:
        records: every request of the run.
        t_event: the event (monotonic seconds).
        t1: end of the window the gaps are taken over.
    """
    longest = max_gap_overlapping(records, t_event, t1)
    for r in records:
        waited_until = r.token_times[0] if r.token_times else r.end
        if r.start <= t_event < waited_until:
            longest = max(longest, waited_until - r.start)
    return longest


def median_gap_within(records: Iterable[RequestRecord], t0: float, t1: float) -> float | None:
    """Median gap lying wholly inside ``[t0, t1]``; None if there is none."""
    inside = [b - a for a, b in gaps(records) if a >= t0 and b <= t1]
    return statistics.median(inside) if inside else None


def tokens_per_s(records: Iterable[RequestRecord], t0: float, t1: float) -> float | None:
    """Tokens (of every request) that arrived in ``[t0, t1)``, per second; None for an
    empty window."""
    if t1 <= t0:
        return None
    n = sum(t0 <= t < t1 for r in records for t in r.token_times)
    return n / (t1 - t0)


def throughput_series(records: list[RequestRecord], t0: float, t1: float,
                      bin_s: float) -> tuple[list[float], list[float]]:
    """Tokens/s in consecutive ``bin_s``-second bins from ``t0`` to ``t1``.

    Returns:
        (bin start times relative to ``t0`` in seconds, tokens/s of each bin).
    """
    n_bins = max(1, int((t1 - t0) / bin_s))
    counts = [0] * n_bins
    for r in records:
        for t in r.token_times:
            i = int((t - t0) / bin_s)
            if 0 <= i < n_bins:
                counts[i] += 1
    return [i * bin_s for i in range(n_bins)], [c / bin_s for c in counts]


def plot_timeline(records: list[RequestRecord], events: list[Event], t0: float, t1: float,
                  path: str, title: str, bin_s: float = 0.5,
                  windows: dict[str, tuple[float, float]] | None = None) -> None:
    """Write a PNG: tokens/s over time, each event a labelled vertical line.

    Args:
        records: the requests of the run.
        events: (monotonic time, label) pairs.
        t0, t1: the plotted window (x axis is seconds since ``t0``).
        path: output PNG file.
        title: plot title.
        bin_s: throughput bin width in seconds.
        windows: name -> (start, end) measurement windows, shaded and labelled.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    xs, ys = throughput_series(records, t0, t1, bin_s)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.step(xs, ys, where="post", color="tab:blue", linewidth=1.2)
    top = max(ys, default=1.0) or 1.0
    for i, (name, (a, b)) in enumerate(sorted((windows or {}).items(), key=lambda kv: kv[1])):
        ax.axvspan(a - t0, b - t0, color=f"C{i + 2}", alpha=0.12)
        ax.text((a + b) / 2 - t0, top * 0.04, name, ha="center", fontsize=8, color=f"C{i + 2}")
    for i, (t, label) in enumerate(sorted(events)):
        ax.axvline(t - t0, color="tab:red", linestyle="--", linewidth=0.9)
        ax.text(t - t0, top * (0.97 - 0.08 * (i % 4)), f" {label}", color="tab:red",
                fontsize=8, va="top")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"tokens/s (bins of {bin_s:g} s)")
    ax.set_title(title)
    ax.set_xlim(0, t1 - t0)
    ax.set_ylim(0, top * 1.05)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
