"""What an outage costs: one fault scenario against a real `elasticep serve` deployment.

It runs under a steady streaming load, prints one JSON line and optionally writes a
tokens/s timeline PNG.

Usage: python -m bench.failover --scenario kill|freeze|kill-rank0|rejoin|scale-up|
       scale-down|double-kill [--ep-size 4] [--scale-to N] [--device cpu|cuda]
       [--concurrency 8] [--max-tokens 64] [--plot timeline.png]
       [--step-rate-out lines.jsonl]

Timeline of one run (monotonic seconds):
  start serve -> fault-free reference pass (every prompt once) -> steady load of
  ``--concurrency`` greedy streams -> healthy window -> the event -> degraded window
  (a rank is out) and/or after window (recovered / rescaled) -> stop load, stop serve.

JSON keys (seconds, tokens/s): interruption_s (the longest any client waited for its
next token across the event: gaps between consecutive tokens overlapping [event, event
handled + 1 s], and the time to first token of every request in flight at the event
that had no token yet), p50_gap_s (healthy window), failed_requests (client errors +
streams cut short without an error), tokens_per_s_healthy / _event / _degraded / _after
(the event window runs from the event until the degraded or after window starts,
SETTLE_S after the new membership was committed; null where the scenario has no such
phase), pause_s (rejoin / scale: the same longest wait, from the join or scale request
until the new membership is committed + 0.5 s), outputs_identical (every completed
request's greedy text equals the reference pass's), detect_s (fault -> the
coordinator's epoch without the victim), admit_s (scale request or join start -> the
new membership committed), join_s (join start -> joiners ready / admitted).

Graph keys: graph_captures (rank -> [captures at the end of the healthy window, at the
end]), survivor_recaptures (the captures added on the survivors: ranks that were not
the event's victims and ran the same worker pid at the end of the healthy window and at
the end; null when no rank reports captures: CPU or graphs off), survivor_ranks, and
relaunched_non_victims (ranks no fault was aimed at that run a new process at the end),
and per window w of healthy / event / degraded / after / join: decode_replays_w and
decode_eager_w (decode steps that replayed a CUDA graph / ran eagerly, summed over the
ranks' step-rate lines whose interval's midpoint lies in w) and decode_replay_share_w
(replays over decode steps; null with no decode step or no such window), with
decode_steps_by_rank (window -> rank -> [replays, eager]).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from bench._commit import commit
from bench._deploy import Run, add_deploy_arguments, deployment_args
from elasticep_testkit.harness import timeline
from elasticep_testkit.harness.faults import resume, signal_ranks, wait_in, wait_out

SCENARIOS = ("kill", "freeze", "kill-rank0", "rejoin", "scale-up", "scale-down", "double-kill")
SETTLE_S = 1.0  # after the new epoch: redo + resubmission before "degraded" is steady


def fault(run: Run, victims: list[int], sig: int, gap_s: float) -> float:
    """Signal each victim's worker (``gap_s`` apart); wait until the coordinator dropped
    them all. Sets ``t_event`` and ``t_settled``; returns the settle time.

    Raises:
        TimeoutError: the membership did not drop them within 30 s.
    """
    since = time.monotonic()
    for t, rank, pid in signal_ranks(run.serve, victims, sig, gap_s):
        run.pids[rank] = pid
        run.mark(f"{signal.Signals(sig).name} rank {rank}", at=t)
        run.t_event = run.t_event or t
    snap = wait_out(run.watch, victims, since)
    run.t_settled = run.mark(f"epoch {snap.epoch}: {victims} out", at=snap.t)
    return snap.t


def resume_frozen(run: Run, rank: int, bound_s: float = 15.0) -> None:
    """SIGCONT an evicted frozen rank; record whether it then exits by itself."""
    run.mark(f"SIGCONT rank {rank}")
    run.extra["frozen_rank_exited_after_resume"] = resume(run.pids[rank], bound_s)


def join(run: Run, join_args: list[str], ranks: list[int], scale_to: int | None) -> float:
    """`elasticep join`; for a scale, POST /scale_elastic_ep once the joiners are ready.
    Waits until ``ranks`` are active; returns that time. Sets ``pause_from``.

    Raises:
        TimeoutError: joiners not ready / not admitted within 300 s.
        RuntimeError: the scale request was refused.
    """
    t_join = run.mark("join started")
    run.serve.join(*join_args)
    run.pause_from = t_join
    if scale_to is not None:
        snap = run.watch.wait_for(lambda s: all(s.states[r] == "ready" for r in ranks), 300,
                                  f"joiners {ranks} ready", after=t_join)
        run.windows["join"] = (t_join, run.mark("joiners ready", at=snap.t))
        code, body = run.serve.scale(scale_to)
        run.pause_from = run.mark(f"POST scale {scale_to}")
        run.t_event = run.t_event or run.pause_from
        if code != 200:
            raise RuntimeError(f"POST /scale_elastic_ep {scale_to} -> {code} {body}")
    snap = wait_in(run.watch, ranks, run.pause_from, 300)
    if scale_to is None:
        run.windows["join"] = (t_join, snap.t)
    run.mark(f"epoch {snap.epoch}: {ranks} in", at=snap.t)
    run.t_admitted = snap.t
    run.t_settled = run.t_settled or snap.t
    return snap.t


def scale_down(run: Run, ep_size: int) -> float:
    """POST /scale_elastic_ep ep_size-1; wait until the highest rank is removed."""
    leaving = ep_size - 1
    code, body = run.serve.scale(leaving)
    run.t_event = run.pause_from = run.mark(f"POST scale {leaving}")
    if code != 200:
        raise RuntimeError(f"POST /scale_elastic_ep {leaving} -> {code} {body}")
    snap = run.watch.wait_for(lambda s: s.states[leaving] == "free", 120,
                              f"rank {leaving} removed", after=run.t_event)
    run.t_settled = run.t_admitted = run.mark(f"epoch {snap.epoch}: rank {leaving} removed",
                                              at=snap.t)
    return snap.t


def scenario(run: Run, name: str, ep_size: int, victim: int) -> None:
    """Run the event of scenario ``name``; fills the run's marks and windows."""
    a = run.args
    if name in ("kill", "kill-rank0", "freeze", "double-kill", "rejoin"):
        victims = {"kill-rank0": [0], "double-kill": [victim, (victim + 1) % ep_size]}.get(
            name, [victim])
        sig = signal.SIGSTOP if name == "freeze" else signal.SIGKILL
        run.event_ranks = victims
        t = fault(run, victims, sig, gap_s=0.1)
        run.windows["event"] = (run.t_event, t + SETTLE_S)
        run.window("degraded", t + SETTLE_S, a.degraded_s)
        if name == "freeze":
            resume_frozen(run, victim)
        if name == "rejoin":
            t = join(run, ["--elastic-ep-join-mode", "recover", "--ranks", str(victim)],
                     [victim], None)
            run.window("after", t + SETTLE_S, a.after_s)
    elif name == "scale-up":
        to = scale_target(a)
        t = join(run, ["--elastic-ep-join-mode", "scale", "--elastic-ep-join-rank-offset",
                       str(ep_size), "--nranks", str(to - ep_size)], list(range(ep_size, to)),
                 to)
        run.windows["event"] = (run.t_event, t + SETTLE_S)
        run.window("after", t + SETTLE_S, a.after_s)
    elif name == "scale-down":
        t = scale_down(run, ep_size)
        run.windows["event"] = (run.t_event, t + SETTLE_S)
        run.window("after", t + SETTLE_S, a.after_s)
    else:
        raise ValueError(f"unknown scenario {name!r}")


def scale_target(args: argparse.Namespace) -> int:
    """The ep size a scale-up grows to: ``--scale-to``, default ``--ep-size`` + 2.

    Raises:
        ValueError: ``--scale-to`` is not above ``--ep-size``.
    """
    to = args.ep_size + 2 if args.scale_to is None else args.scale_to
    if to <= args.ep_size:
        raise ValueError(f"--scale-to {to} must exceed --ep-size {args.ep_size}")
    return to


def report(run: Run, name: str) -> dict:
    """The JSON line of a finished run."""
    recs, w = run.records, run.windows
    oc = run.outcomes()

    def tps(window: str) -> float | None:
        return _r(timeline.tokens_per_s(recs, *w[window]), 1) if window in w else None

    out = {
        "bench": "failover", "scenario": name,
        "interruption_s": _r(timeline.max_wait_across(recs, run.t_event, run.t_settled + 1.0)),
        "p50_gap_s": _r(timeline.median_gap_within(recs, *w["healthy"])),
        "failed_requests": len(oc.errors) + oc.silent_losses,
        "tokens_per_s_healthy": tps("healthy"),
        "tokens_per_s_event": tps("event"),
        "tokens_per_s_degraded": tps("degraded"),
        "tokens_per_s_after": tps("after"),
        "pause_s": None if run.pause_from is None else _r(
            timeline.max_wait_across(recs, run.pause_from, run.t_admitted + 0.5)),
        "outputs_identical": oc.outputs_identical,
        "requests": oc.total, "completed": oc.completed, "mismatched": len(oc.mismatched),
        "epochs": sorted({s.epoch for s in run.watch.history}),
    }
    if name == "scale-up":
        out["scale_to"] = scale_target(run.args)
    if name in ("scale-up", "scale-down"):
        out["admit_s"] = _r(run.t_admitted - run.t_event)
    else:
        out["detect_s"] = _r(run.t_settled - run.t_event)
    if "join" in w:
        out["join_s"] = _r(w["join"][1] - w["join"][0])
        out["tokens_per_s_during_join"] = tps("join")
    if oc.errors:
        out["first_error"] = oc.errors[0][:300]
    return {**out, **run.extra, **run.meta()}


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=SCENARIOS, required=True)
    ap.add_argument("--victim", type=int, default=2,
                    help="rank to kill / freeze / rejoin (kill-rank0 always takes rank 0)")
    ap.add_argument("--degraded-s", type=float, default=8.0, help="degraded window, seconds")
    ap.add_argument("--after-s", type=float, default=8.0, help="after window, seconds")
    ap.add_argument("--scale-to", type=int, default=None,
                    help="scale-up: the ep size to grow to (default: --ep-size + 2; "
                         "--max-ep-size is set to it), e.g. --ep-size 2 --scale-to 3")
    add_deploy_arguments(ap)
    args = ap.parse_args()
    if args.scale_to is not None and args.scenario != "scale-up":
        ap.error("--scale-to applies to --scenario scale-up only")
    try:
        extra = (["--max-ep-size", str(scale_target(args))] if args.scenario == "scale-up"
                 else [])
    except ValueError as exc:
        ap.error(str(exc))
    with Run(args, deployment_args(args) + extra) as run:
        run.healthy_phase()
        scenario(run, args.scenario, args.ep_size, args.victim)
        run.finish()
        line = report(run, args.scenario)
        if args.plot:
            run.plot(args.plot, f"{args.scenario}: EP{args.ep_size}, "
                                f"{args.concurrency} streams, {args.device}")
    print(json.dumps({"commit": commit(), **line}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
