"""The share of decode steps that replayed a CUDA graph, per measurement window, read
from the ranks' step-rate lines (:mod:`elasticep.engine.step_rate`).

Each line covers the ``dt`` seconds before its timestamp and counts that interval's
decode steps that replayed a graph and that ran eagerly. A line belongs to the window
that holds its interval's midpoint (with ``--log-stats-interval 1``, an interval is
about a second, so a window's edges are right to about half a second). The timestamp
is the worker's local wall clock (``logging``'s ``asctime``, millisecond resolution);
the bench converts it to its monotonic clock with an offset taken on the same machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_LINE = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?: INFO rank (?P<rank>\d+) epoch "
    r"(?P<epoch>\d+): (?P<steps>\d+) steps in (?P<dt>[\d.]+) s .*?decode CUDA graph "
    r"replays: (?P<replays>\d+) of (?P<decode>\d+) decode steps \((?P<eager>\d+) eager\)")


@dataclass(frozen=True)
class StepRateLine:
    """One parsed step-rate line.

    Attributes:
        t_wall: the line's timestamp, seconds since the epoch (local clock).
        dt: the interval it covers, seconds (ending at ``t_wall``).
        rank, epoch: the rank and its epoch.
        steps: committed steps of the interval.
        replays, eager: decode steps of the interval that replayed a graph / ran eagerly.
        text: the line as logged.
    """

    t_wall: float
    dt: float
    rank: int
    epoch: int
    steps: int
    replays: int
    eager: int
    text: str


def parse_line(text: str) -> StepRateLine | None:
    """The step-rate line in ``text`` (one log line), or None if it is none.

    Raises:
        ValueError: ``replays + eager`` differs from the line's decode-step count.
    """
    m = _LINE.match(text)
    if m is None:
        return None
    replays, eager, decode = int(m["replays"]), int(m["eager"]), int(m["decode"])
    if replays + eager != decode:
        raise ValueError(f"step-rate line counts {replays} + {eager} != {decode}: {text!r}")
    t = datetime.strptime(m["ts"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return StepRateLine(t, float(m["dt"]), int(m["rank"]), int(m["epoch"]), int(m["steps"]),
                        replays, eager, text.rstrip("\n"))


def read_lines(log_dir: Path) -> list[StepRateLine]:
    """Every step-rate line in ``log_dir``'s ``rank<r>.log`` files (each process of a
    slot appends to its file), in time order."""
    out: list[StepRateLine] = []
    for path in sorted(log_dir.glob("rank*.log")):
        with open(path, errors="replace") as f:
            out += [p for p in map(parse_line, f) if p is not None]
    return sorted(out, key=lambda p: (p.t_wall, p.rank))


def window_of(line: StepRateLine, windows: dict[str, tuple[float, float]],
              wall_minus_mono: float) -> str | None:
    """The window (name -> monotonic (t0, t1), seconds) holding the midpoint of the
    line's interval, or None. ``wall_minus_mono``: ``time.time() - time.monotonic()``.
    Overlapping windows (``join`` spans others): the first in ``windows``' order."""
    mid = line.t_wall - line.dt / 2 - wall_minus_mono
    return next((name for name, (t0, t1) in windows.items() if t0 <= mid < t1), None)


def summarize(lines: list[StepRateLine], windows: dict[str, tuple[float, float]],
              wall_minus_mono: float) -> dict:
    """JSON keys per window ``w`` of ``windows``: ``decode_replays_w``,
    ``decode_eager_w`` (summed over every rank's lines in ``w``) and
    ``decode_replay_share_w`` (replays / decode steps, rounded to 4 places; None with no
    decode step), plus ``decode_steps_by_rank``: window -> rank -> [replays, eager]."""
    by_rank: dict[str, dict[int, list[int]]] = {w: {} for w in windows}
    for line in lines:
        w = window_of(line, windows, wall_minus_mono)
        if w is not None:
            counts = by_rank[w].setdefault(line.rank, [0, 0])
            counts[0] += line.replays
            counts[1] += line.eager
    out: dict = {}
    for w, ranks in by_rank.items():
        replays = sum(c[0] for c in ranks.values())
        eager = sum(c[1] for c in ranks.values())
        out[f"decode_replays_{w}"] = replays
        out[f"decode_eager_{w}"] = eager
        out[f"decode_replay_share_{w}"] = (round(replays / (replays + eager), 4)
                                           if replays + eager else None)
    out["decode_steps_by_rank"] = {w: {r: c for r, c in sorted(ranks.items())}
                                   for w, ranks in by_rank.items()}
    return out
