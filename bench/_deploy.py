"""What the serving benches share: deployment flags, and a :class:`Run` that starts
`elasticep serve`, computes the fault-free reference, keeps a steady streaming load,
records event times and windows, and stops everything (bounded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench import _decode_share
from elasticep.utils.procs import pid_alive
from elasticep_testkit.harness import timeline
from elasticep_testkit.harness.load import (
    Outcomes,
    RequestRecord,
    SteadyLoad,
    make_client,
    outcomes,
    run_batch,
)
from elasticep_testkit.harness.serve_process import ServeProcess
from elasticep_testkit.harness.status_watch import StatusWatch
from elasticep_testkit.prompts import gsm8k_prompts

REQUEST_TIMEOUT_S = 120.0  # per request: a hang becomes a client error, never a stuck bench


def add_deploy_arguments(ap: argparse.ArgumentParser) -> None:
    """Flags of the deployment and of the load, shared by every serving bench."""
    ap.add_argument("--ep-size", type=int, default=4)
    ap.add_argument("--ep-num-redundant-experts", type=int, default=16)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    ap.add_argument("--heartbeat-timeout", type=float, default=None,
                    help="seconds (default: serve's default)")
    ap.add_argument("--concurrency", type=int, default=8, help="streams kept in flight")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--num-prompts", type=int, default=16, help="GSM8K prompts cycled over")
    ap.add_argument("--warmup-s", type=float, default=3.0, help="load before measuring, s")
    ap.add_argument("--healthy-s", type=float, default=8.0, help="healthy window, seconds")
    ap.add_argument("--plot", default=None, help="write the tokens/s timeline PNG here")
    ap.add_argument("--disable-cuda-graph", action="store_true",
                    help="serve without decode CUDA graphs (both backends alike in overhead.py)")
    ap.add_argument("--log-dir", default=None,
                    help="keep serve.log and the ranks' logs here (default: a temp dir)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra flag passed to serve verbatim (repeatable)")
    ap.add_argument("--step-rate-out", default=None,
                    help="write the ranks' step-rate lines the decode replay shares were "
                         "counted from here (JSON lines: window, rank, t_s from the load's "
                         "start, the line as logged)")


def deployment_args(args: argparse.Namespace) -> list[str]:
    """`elasticep serve` flags from the parsed bench flags."""
    out = ["--ep-size", str(args.ep_size), "--ep-num-redundant-experts",
           str(args.ep_num_redundant_experts), "--device", args.device]
    if args.model:
        out += ["--model", args.model]
    if args.heartbeat_timeout is not None:
        out += ["--heartbeat-timeout", str(args.heartbeat_timeout)]
    if args.disable_cuda_graph:
        out.append("--disable-cuda-graph")
    # ranks report their counters (graph captures, for the JSON line) with each
    # throughput line: once a second, so the last report follows the event
    return out + ["--log-stats-interval", "1"] + list(args.serve_arg)


def cuda_graph_on(args: argparse.Namespace) -> bool:
    """Whether the deployment the bench flags describe replays decode CUDA graphs."""
    return args.device == "cuda" and not args.disable_cuda_graph


def machine() -> str:
    """One line naming the machine: CPU model, cores, and the GPU if torch sees one."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def survivor_recaptures(captures_before: dict[int, float], captures_after: dict[int, float],
                        pids_before: dict[int, int], pids_after: dict[int, int],
                        victims: list[int]) -> dict[str, Any]:
    """CUDA graph re-captures on the ranks that lived through the run.

    A survivor is a rank that was not a victim of the event and ran the same process
    (the same pid) at the end of the healthy window and at the end: a joiner had no
    process before, and a rank that died and was relaunched has a new pid (the
    captures gauge of a rank keeps its last value after it dies, and a relaunched
    rank's counts start anew, so neither says whether it re-captured).

    Args:
        captures_before, captures_after: rank -> ``elasticep_cuda_graph_captures`` at
            the end of the healthy window and at the end.
        pids_before, pids_after: rank -> pid of its running worker at those times.
        victims: the ranks the event took.

    Returns:
        ``survivor_recaptures`` (captures added on the survivors; None when no rank
        reports captures: CPU, or graphs off), ``survivor_ranks`` (sorted), and
        ``relaunched_non_victims`` (ranks that were no victim but run a new process:
        a failure the scenario did not plan).
    """
    kept = sorted(r for r, pid in pids_before.items()
                  if r not in victims and pids_after.get(r) == pid
                  and r in captures_before and r in captures_after)
    relaunched = sorted(r for r, pid in pids_before.items()
                        if r not in victims and r in pids_after and pids_after[r] != pid)
    total = (int(sum(captures_after[r] - captures_before[r] for r in kept))
             if captures_after else None)
    return {"survivor_recaptures": total, "survivor_ranks": kept,
            "relaunched_non_victims": relaunched}


class Run:
    """One deployment under a steady load (a context manager that stops everything).

    Attributes:
        serve, watch: the deployment and its coordinator watch.
        reference: prompt index -> fault-free greedy text.
        events: (time, label) marks for the plot.
        windows: name -> (t0, t1) measurement windows.
        t_event: the first disruptive action; t_settled: when the coordinator committed
            its result; pause_from / t_admitted: the window pause_s is measured over
            (a join or scale request until the new membership is committed).
        pids: rank -> worker pid signalled.
        extra: scenario-specific JSON keys; :meth:`finish` adds the graph captures
            and the decode replay shares per window (:mod:`bench._decode_share`).
        records, orphans: filled by :meth:`finish`.
    """

    SHARE_WINDOWS = ("healthy", "event", "degraded", "after")  # keys always in the JSON

    def __init__(self, args: argparse.Namespace, serve_args: list[str]) -> None:
        self.args = args
        self.events: list[tuple[float, str]] = []
        self.windows: dict[str, tuple[float, float]] = {}
        self.t_event: float | None = None
        self.t_settled: float | None = None
        self.pause_from: float | None = None
        self.t_admitted: float | None = None
        self.pids: dict[int, int] = {}
        self.extra: dict[str, Any] = {}
        self.event_ranks: list[int] = []  # the ranks a fault took (set by the scenario)
        self.records: list[RequestRecord] = []
        self.orphans: list[int] = []
        self.load: SteadyLoad | None = None
        self.watch: StatusWatch | None = None
        self.wall_minus_mono = time.time() - time.monotonic()  # step-rate line times
        self.serve = ServeProcess.start(serve_args, log_dir=args.log_dir)
        try:
            self.watch = StatusWatch(self.serve.coordinator)
            self.client = make_client(self.serve.url, REQUEST_TIMEOUT_S)
            self.model = self.serve.model_name()
            self.prompts = gsm8k_prompts(args.num_prompts)
            self.reference = self._reference()
            self.t0 = time.monotonic()
            self.load = SteadyLoad(self.client, self.model, self.prompts, args.concurrency,
                                   args.max_tokens)
        except BaseException:
            self.finish()
            raise

    def _reference(self) -> dict[int, str]:
        """Fault-free greedy text of every prompt, ``concurrency`` at a time.

        Raises:
            RuntimeError: a reference request failed.
        """
        texts: dict[int, str] = {}
        k = self.args.concurrency
        for lo in range(0, len(self.prompts), k):
            recs = run_batch(self.client, self.model, self.prompts[lo:lo + k],
                             self.args.max_tokens, REQUEST_TIMEOUT_S)
            for r in recs:
                if not r.complete(self.args.max_tokens):
                    raise RuntimeError(f"fault-free reference request failed: {r}")
                texts[lo + r.prompt_idx] = r.text
        return texts

    def mark(self, label: str, at: float | None = None) -> float:
        """Add a plot event at ``at`` (default now); returns its time."""
        t = time.monotonic() if at is None else at
        self.events.append((t, label))
        return t

    def window(self, name: str, start: float, length_s: float) -> None:
        """Record window ``name`` = [start, start + length_s]; sleep until it ends."""
        self.windows[name] = (start, start + length_s)
        time.sleep(max(0.0, start + length_s - time.monotonic()))

    def healthy_phase(self) -> None:
        """Warm up, then measure the healthy window (noting each rank's CUDA graph
        captures at its end, against which :meth:`finish` counts re-captures)."""
        self.window("healthy", self.t0 + self.args.warmup_s, self.args.healthy_s)
        self._captures_healthy = self._captures()
        self._pids_healthy = self._live_pids()

    def _captures(self) -> dict[int, float]:
        try:
            return self.serve.rank_metric("elasticep_cuda_graph_captures")
        except Exception:  # noqa: BLE001 - a diagnostic only; serve may be down
            return {}

    def _live_pids(self) -> dict[int, int]:
        """rank -> worker pid, for the ranks whose named process is running now."""
        try:
            named = self.serve.status().pids()
        except Exception:  # noqa: BLE001 - a diagnostic only; serve may be down
            return {}
        return {r: p for r, p in named.items() if pid_alive(p)}

    def finish(self) -> None:
        """Stop the load (in-flight requests finish), the watch and serve. Idempotent."""
        if self.load is not None:
            self.mark("load stopped")
            self.records = self.load.stop(REQUEST_TIMEOUT_S + 10)
            self.load = None
        if self.watch is not None:
            self.watch.stop()
        if self.serve.proc.poll() is None:
            if hasattr(self, "_captures_healthy") and "graph_captures" not in self.extra:
                # rank -> [captures after the healthy window, at the end]: a survivor
                # whose two counts differ re-captured; a relaunched rank starts anew
                end = self._captures()
                self.extra["graph_captures"] = {
                    r: [self._captures_healthy.get(r), end.get(r)]
                    for r in sorted(set(end) | set(self._captures_healthy))}
                self.extra.update(survivor_recaptures(
                    self._captures_healthy, end, self._pids_healthy, self._live_pids(),
                    self.event_ranks))
            self.orphans = self.serve.stop()
            if hasattr(self, "_captures_healthy") and "decode_steps_by_rank" not in self.extra:
                self._decode_shares()

    def _decode_shares(self) -> None:
        """Add the decode replay share of every window to :attr:`extra` (from the ranks'
        logs; written to ``--step-rate-out`` when given)."""
        lines = _decode_share.read_lines(self.serve.log_path.parent)
        self.extra.update(_decode_share.summarize(lines, self.windows, self.wall_minus_mono))
        for w in self.SHARE_WINDOWS:
            for key in ("decode_replays", "decode_eager", "decode_replay_share"):
                self.extra.setdefault(f"{key}_{w}", None)
        out = getattr(self.args, "step_rate_out", None)
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            with open(out, "w") as f:
                for line in lines:
                    mono = line.t_wall - self.wall_minus_mono
                    f.write(json.dumps({
                        "window": _decode_share.window_of(line, self.windows,
                                                          self.wall_minus_mono),
                        "rank": line.rank, "t_s": round(mono - self.t0, 3),
                        "line": line.text}) + "\n")

    def outcomes(self) -> Outcomes:
        """Errors, silent losses and mismatches of every load request."""
        return outcomes(self.records, self.reference, self.args.max_tokens)

    def plot(self, path: str, title: str) -> None:
        """The tokens/s timeline PNG with the events."""
        t1 = max((r.end for r in self.records), default=time.monotonic())
        timeline.plot_timeline(self.records, self.events, self.t0, t1, path, title,
                               windows=self.windows)

    def meta(self) -> dict[str, Any]:
        """JSON keys describing the setup."""
        a = self.args
        return {"model": Path(a.model).name if a.model else "tiny-qwen3-moe",
                "ep_size": a.ep_size, "redundant": a.ep_num_redundant_experts,
                "device": a.device, "cuda_graph": cuda_graph_on(a),
                "concurrency": a.concurrency, "max_tokens": a.max_tokens,
                "orphans": self.orphans, "machine": machine(),
                "load_avg_1m": round(os.getloadavg()[0], 1)}

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()
