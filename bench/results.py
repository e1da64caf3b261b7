"""Regenerate docs/results.md: every failover scenario, the overhead A/B and a chaos run,
each as its own subprocess, then one page with the JSON lines, a table against the
targets and the timeline plots (docs/results/*.png).

Usage: python -m bench.results [--scenarios kill,rejoin,...] [--chaos-trials 5]
       [--skip-overhead] [--device cpu|cuda]        (or: make results)
       python -m bench.results --rerun kill,freeze  # redo some parts, keep the rest
       python -m bench.results --rerun none         # only redraw the page

Every part's result is also kept in docs/results/results.json, which ``--rerun`` reads
(part names: the scenarios, "overhead", "chaos"), each with the commit, time and machine
it was taken at: the page names them per part, so parts of different runs are never
shown under one "taken at" line.

A run that fails is reported as failed on the page, with the end of its stderr; the
others still run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

from bench._deploy import machine
from bench.failover import SCENARIOS

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "results.md"
PLOTS = REPO / "docs" / "results"
SAVED = PLOTS / "results.json"
BOUND_S = 600  # one bench run; the page records a timeout as a failure

# scenario -> (JSON key, target as text, predicate) of the targets
TARGETS = {
    "kill": ("interruption_s", "<= 1.0 s", lambda v: v <= 1.0),
    "kill-rank0": ("interruption_s", "<= 1.0 s", lambda v: v <= 1.0),
    "double-kill": ("interruption_s", "<= 1.0 s (two kills)", lambda v: v <= 1.0),
    "freeze": ("interruption_s", "<= 3.0 s", lambda v: v <= 3.0),
    "rejoin": ("pause_s", "<= 0.5 s", lambda v: v <= 0.5),
    "scale-up": ("pause_s", "<= 1.0 s", lambda v: v <= 1.0),
    "scale-down": ("pause_s", "", None),
}


Stamp = dict[str, str]


def stamp() -> Stamp:
    """When, at which commit and on which machine a part is taken now; the commit gets
    ``-dirty`` when tracked files other than this script's outputs differ from it."""
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    # this script's own outputs (the page, the plots, the saved parts) do not count:
    # each part is stamped after it has written its plot
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":!docs/results.md", ":!docs/results"],
                           capture_output=True, text=True).stdout.strip()
    return {"commit": commit + ("-dirty" if dirty else ""), "machine": machine(),
            "taken": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def taken(st: Stamp | None) -> str:
    """``2026-11-30 22:00 UTC, `abc1234`, <machine>`` (or that the part has no stamp)."""
    if not st:
        return "unknown (saved before parts were stamped)"
    return f"{st['taken']}, `{st['commit']}`, {st['machine']}"


def run_json(cmd: list[str]) -> tuple[dict | None, str]:
    """Run one bench; returns (its last JSON line or None, stderr tail / failure)."""
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {BOUND_S} s"
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return None, f"exit {p.returncode}: {p.stderr[-1500:]}"
    return json.loads(lines[-1]), ""


def scenario_row(name: str, r: dict | None, why: str, st: Stamp | None = None) -> str:
    """One markdown table row for a failover scenario, ending with when it was taken."""
    if r is None:
        return (f"| {name} | FAILED: {why.splitlines()[-1][:120] if why else '?'} |||||||"
                f"| {taken(st)} |")
    key, target, ok = TARGETS[name]
    v = r.get(key)
    verdict = "" if v is None or ok is None else (" (met)" if ok(v) else " (missed)")
    target = f", target {target}" if target else " (no target)"
    ratio = (r["tokens_per_s_degraded"] / r["tokens_per_s_healthy"]
             if r.get("tokens_per_s_degraded") and r.get("tokens_per_s_healthy") else None)
    def show(x: object) -> str:
        return "-" if x is None else str(x)

    return (f"| {name} | {key} = {v} s{target}{verdict} | {r['p50_gap_s']} | "
            f"{r['failed_requests']} | {show(r['tokens_per_s_healthy'])} / "
            f"{show(r.get('tokens_per_s_event'))} / "
            f"{show(r['tokens_per_s_degraded'])} / {show(r['tokens_per_s_after'])} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} | {r['outputs_identical']} | "
            f"{r.get('detect_s', r.get('admit_s'))} | {taken(st)} |")


def render(failover: dict[str, tuple], overhead: tuple | None, chaos: tuple | None,
           device: str) -> str:
    """The whole page. Each part is ``(result, why failed[, stamp])`` (chaos:
    ``(exit status, output[, stamp])``); the stamp says when it was taken."""
    stamps = {taken(p[2] if len(p) > 2 else None)
              for p in [*failover.values(), overhead, chaos] if p is not None}
    when = (f"Taken {stamps.pop()}, device `{device}`." if len(stamps) == 1 else
            f"Parts were taken at different times (`--rerun`): each says when, at which "
            f"commit and on which machine. Device `{device}`.")
    out = [
        "# Measured results",
        "",
        when,
        "Regenerate with `make results` (= `.venv/bin/python -m bench.results`).",
        "",
        "Caveat: the machine is small and shared; timings vary run to run with whatever",
        "else runs. Each scenario is one run of `bench/failover.py` (EP4, demo model,",
        "16 redundant expert slots, 8 concurrent greedy streams of 64 tokens).",
        "",
        "Single commands:",
        "",
        "```",
        ".venv/bin/python -m bench.failover --scenario kill|freeze|kill-rank0|rejoin|scale-up|"
        "scale-down|double-kill --plot out.png",
        ".venv/bin/python -m bench.overhead --repeats 5",
        ".venv/bin/python -m elasticep_testkit.chaos --trials 50 --seed 1     # the long chaos run",
        ".venv/bin/python -m elasticep_testkit.chaos --trials 10 --seed 0 --nnodes 2  "
        "# leader-kill, node-0-host-kill (etcd; 2 trials in CI)",
        ".venv/bin/pytest -q tests/test_chaos_short.py                # 2 trials, CI",
        "```",
        "",
        "## Failover (`bench/failover.py --scenario S`)",
        "",
        "| scenario | headline | p50 gap (s) | failed requests | tokens/s healthy / "
        "event / degraded / after | degraded / healthy | outputs identical | "
        "detect or admit (s) | taken |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    out += [scenario_row(name, *failover[name]) for name in failover]
    out += ["", "Definitions are in the docstring of `bench/failover.py`. Plots (tokens/s in "
            "0.5 s bins; dashed lines are events, shaded spans the measured windows):", ""]
    out += [f"![{name}](results/{name}.png)" for name, p in failover.items() if p[0]]
    out += ["", "Raw JSON lines:", "", "```"]
    out += [json.dumps(p[0]) if p[0] else f"{name}: FAILED {p[1]}"
            for name, p in failover.items()]
    out += ["```", ""]
    if overhead is not None:
        r, why = overhead[:2]
        out += ["## Steady-state overhead (`bench/overhead.py`)", "",
                f"Taken {taken(overhead[2] if len(overhead) > 2 else None)}.", ""]
        if r is None:
            out += [f"FAILED: {why}", ""]
        else:
            noise = max(r["spread_elastic"], r["spread_none"])
            out += [f"elastic / none = **{r['ratio']}** (medians {r['tokens_per_s_elastic']} vs "
                    f"{r['tokens_per_s_none']} tokens/s over {r['repeats']} interleaved pairs; "
                    f"spread up to {noise:.1%}, so a difference below that is noise). Target "
                    ">= 0.99.", "", "```", json.dumps(r), "```", ""]
    if chaos is not None:
        rc, text = chaos[:2]
        out += ["## Chaos (`python -m elasticep_testkit.chaos`)", "",
                f"Taken {taken(chaos[2] if len(chaos) > 2 else None)}.", "",
                f"Exit status {rc} ({'no violation' if rc == 0 else 'VIOLATIONS'}).", "", "```",
                text.strip(), "```", ""]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--chaos-trials", type=int, default=5, help="0: skip the chaos run")
    ap.add_argument("--chaos-seed", type=int, default=1)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--rerun", default=None,
                    help="only these parts (comma-separated); the others come from "
                         "docs/results/results.json")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    PLOTS.mkdir(parents=True, exist_ok=True)
    saved = json.loads(SAVED.read_text()) if args.rerun and SAVED.exists() else {}
    todo = set(args.rerun.split(",")) if args.rerun else None
    py = sys.executable
    failover = {k: tuple(v) for k, v in saved.get("failover", {}).items()}
    for name in args.scenarios.split(","):
        if todo is None or name in todo:
            failover[name] = (*run_json([py, "-m", "bench.failover", "--scenario", name,
                                         "--device", args.device, "--plot",
                                         str(PLOTS / f"{name}.png")]), stamp())
            print(f"{name}: {json.dumps(failover[name][0]) or failover[name][1]}", flush=True)
    failover = {n: failover[n] for n in SCENARIOS if n in failover}
    overhead = tuple(saved["overhead"]) if saved.get("overhead") else None
    if not args.skip_overhead and (todo is None or "overhead" in todo):
        overhead = (*run_json([py, "-m", "bench.overhead", "--device", args.device]), stamp())
        print(f"overhead: {json.dumps(overhead[0]) or overhead[1]}", flush=True)
    chaos = tuple(saved["chaos"]) if saved.get("chaos") else None
    if args.chaos_trials and (todo is None or "chaos" in todo):
        cmd = [py, "-m", "elasticep_testkit.chaos", "--trials", str(args.chaos_trials), "--seed",
               str(args.chaos_seed), "--device", args.device]
        try:
            p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                               timeout=BOUND_S * args.chaos_trials)
            chaos = (p.returncode, p.stdout, stamp())
        except subprocess.TimeoutExpired as exc:
            chaos = (-1, f"{exc.stdout or ''}\ntimed out after {exc.timeout:.0f} s", stamp())
        print(chaos[1], flush=True)
    SAVED.write_text(json.dumps({"failover": failover, "overhead": overhead, "chaos": chaos},
                                indent=1))
    DOC.write_text(render(failover, overhead, chaos, args.device))
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
