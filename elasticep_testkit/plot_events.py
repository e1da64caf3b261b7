"""Plot an ``--event-log`` file as a timeline PNG: each rank's state over time, and
every phase of a death, rejoin or scale as a bar over the time it took.

    python -m elasticep_testkit.plot_events EVENTS.jsonl -o timeline.png

Times are seconds since the first event. Needs matplotlib (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elasticep.frontend.event_log import read_events

# one colour per slot state, as /elastic_ep_status names them
STATE_COLOURS = {"healthy": "tab:green", "draining": "tab:orange", "joining": "tab:blue",
                 "ready": "tab:cyan", "failed": "tab:red", "free": "lightgrey"}


def state_segments(events: list[dict], t0: float, t_end: float,
                   ) -> dict[int, list[tuple[float, float, str]]]:
    """rank -> [(start, end, state)] in seconds since ``t0`` (pure). A rank's first
    segment starts at its first state event; its last ends at ``t_end``."""
    segs: dict[int, list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("event") != "rank_state":
            continue
        rank, t = int(e["rank"]), e["t"] - t0
        rows = segs.setdefault(rank, [])
        if rows:
            start, _end, state = rows[-1]
            rows[-1] = (start, t, state)
        rows.append((t, t_end, e["state"]))
    return segs


def phase_bars(events: list[dict], t0: float) -> list[tuple[str, float, float]]:
    """(label, start, duration) of every event that ends a phase, in seconds since
    ``t0`` (pure)."""
    out = []
    for e in events:
        if "seconds" not in e:
            continue
        who = (f" rank {e['rank']}" if "rank" in e
               else f" {e['kind']}" if "kind" in e else "")
        out.append((f"{e['event']}{who}", e["t"] - t0 - e["seconds"], e["seconds"]))
    return out


def plot(events: list[dict], out: Path) -> None:
    """Write the timeline of ``events`` to ``out`` (PNG).

    Raises:
        ValueError: no events.
    """
    if not events:
        raise ValueError("the event log is empty")
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    t0 = min(e["t"] for e in events)
    t_end = max(e["t"] for e in events) - t0 + 1e-3
    segs = state_segments(events, t0, t_end)
    bars = phase_bars(events, t0)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 2 + 0.4 * (
        len(segs) + len(bars))), gridspec_kw={"height_ratios": [max(1, len(segs)),
                                                                max(1, len(bars))]})
    for row, (_rank, rows) in enumerate(sorted(segs.items())):
        for start, end, state in rows:
            top.barh(row, end - start, left=start, color=STATE_COLOURS.get(state, "black"))
    top.set_yticks(range(len(segs)), [f"rank {r}" for r in sorted(segs)])
    top.set_title("slot states (colour) and recovery phases (bars)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STATE_COLOURS.values()]
    top.legend(handles, list(STATE_COLOURS), ncol=6, fontsize="small", loc="upper right")
    for e in events:
        if e.get("event") == "epoch":
            for ax in (top, bottom):
                ax.axvline(e["t"] - t0, color="grey", lw=0.5, ls=":")
    for row, (_label, start, seconds) in enumerate(bars):
        bottom.barh(row, max(seconds, t_end / 500), left=start, color="tab:purple")
        bottom.text(start + seconds, row, f" {seconds:.3f} s", va="center", fontsize="small")
    bottom.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize="small")
    bottom.set_xlabel("seconds since the first event")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elasticep_testkit.plot_events",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("event_log", help="the file serve --event-log wrote")
    p.add_argument("-o", "--output", default="timeline.png", help="PNG to write "
                   "(default: %(default)s)")
    args = p.parse_args(argv)
    try:
        plot(read_events(args.event_log), Path(args.output))
    except (OSError, ValueError) as exc:
        print(f"plot_events: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
