"""ElasticEP demo (`make demo`): serve through a rank death, a rejoin and a scale-up.

1. starts `elasticep serve` with EP4 on the embedded demo model (16 redundant expert
   slots, capacity for 6 ranks);
2. streams GSM8K questions through the `openai` client from a few concurrent clients;
3. SIGKILLs one rank (pid from /elastic_ep_status) while streams are running, relaunches
   it with `elasticep join ... recover`, then starts two more ranks with
   `elasticep join ... scale` and admits them with POST /scale_elastic_ep;
4. prints requests sent/completed, errors, the longest stream gap, the epoch at each
   event and tokens/s per phase, and stops every process it started.

Runs in about 1-2 minutes on 2 CPU cores. Logs of serve and join go to a temp dir.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from elasticep.harness.serve_process import cli_command, free_port
from elasticep.utils.procs import pid_alive
from elasticep.utils.wait import wait_until

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "data" / "gsm8k" / "test_head64.jsonl"  # GSM8K test items, MIT licence


@dataclass
class Load:
    """Concurrent streaming clients and what they saw."""

    client: openai.OpenAI
    model: str
    questions: list[str]
    max_tokens: int
    sent: int = 0
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    max_gap: tuple[float, float] = (0.0, 0.0)  # (seconds between two tokens, when it ended)
    max_ttft: float = 0.0  # longest wait for a first token (queueing included), seconds
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client_loop(self, worker: int, n_workers: int) -> None:
        i = worker
        while not self.stop.is_set():
            question = self.questions[i % len(self.questions)]
            i += n_workers
            with self.lock:
                self.sent += 1
            start, last = time.monotonic(), None
            try:
                for _ in self.client.completions.create(
                        model=self.model, prompt=f"Question: {question}\nAnswer:",
                        max_tokens=self.max_tokens, temperature=0, stream=True):
                    now = time.monotonic()
                    with self.lock:
                        self.token_times.append(now)
                        if last is None:
                            self.max_ttft = max(self.max_ttft, now - start)
                        elif now - last > self.max_gap[0]:
                            self.max_gap = (now - last, now)
                    last = now
                with self.lock:
                    self.completed += 1
            except openai.OpenAIError as exc:
                with self.lock:
                    self.errors.append(repr(exc))

    def tokens_between(self, t0: float, t1: float) -> int:
        with self.lock:
            return sum(t0 <= t < t1 for t in self.token_times)


class Demo:
    """The serve subprocess, the join subprocesses, and the event timeline."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.logs = Path(tempfile.mkdtemp(prefix="elasticep-demo-"))
        self.port, self.coord = free_port(), f"127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.events: list[tuple[float, str, int, int, int]] = []
        self.t0 = time.monotonic()

    # ---- processes ---------------------------------------------------------------------
    def start_serve(self) -> None:
        cmd = cli_command("serve", "--ep-size", "4", "--ep-num-redundant-experts", "16",
                          "--max-ep-size", "6", "--port", str(self.port),
                          "--dist-init-addr", self.coord, "--heartbeat-timeout", "1.0")
        print(f"$ elasticep {' '.join(cmd[3:])}\n  (logs in {self.logs})", flush=True)
        serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                 stderr=open(self.logs / "serve.log", "w"),  # noqa: SIM115
                                 start_new_session=True)
        self.procs.append(serve)
        for line in serve.stdout:  # the one ready line ends the wait
            print(f"  {line.strip()}", flush=True)
            if line.startswith("ready"):
                return
        raise RuntimeError(f"serve exited before it was ready; see {self.logs}/serve.log")

    def join(self, *args: str) -> None:
        name = f"join{len(self.procs)}.log"
        print(f"$ elasticep join --dist-init-addr {self.coord} {' '.join(args)}", flush=True)
        self.procs.append(subprocess.Popen(
            cli_command("join", "--dist-init-addr", self.coord, *args),
            stdout=open(self.logs / name, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True))

    def stop_all(self) -> list[int]:
        """SIGINT serve (Ctrl-C), then the joins; returns pids of ranks still alive."""
        pids = {r["pid"] for r in self.status_or_empty().get("ranks", []) if r["pid"]}
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        time.sleep(0.5)
        return sorted(p for p in pids if pid_alive(p))

    # ---- status --------------------------------------------------------------------------
    def status(self) -> dict:
        return httpx.get(f"{self.url}/elastic_ep_status", timeout=10).json()

    def status_or_empty(self) -> dict:
        try:
            return self.status()
        except httpx.HTTPError:
            return {}

    def wait(self, pred, what: str, timeout_s: float = 120) -> dict:
        seen: list[dict] = [{}]

        def check() -> dict | None:
            seen[0] = self.status()
            return seen[0] if pred(seen[0]) else None

        return wait_until(check, timeout_s, what, last=lambda: seen[0])

    def event(self, what: str) -> float:
        st = self.status()
        healthy = sum(r["state"] == "healthy" for r in st["ranks"])
        now = time.monotonic()
        self.events.append((now, what, st["epoch"], st["ep_size"], healthy))
        print(f"  [{now - self.t0:6.1f} s] epoch {st['epoch']:>2}  {what}", flush=True)
        return now


def healthy_count(st: dict) -> int:
    return sum(r["state"] == "healthy" for r in st["ranks"])


def run(args: argparse.Namespace) -> int:
    demo = Demo(args)
    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines()]
    load = None
    pool = None
    try:
        demo.start_serve()
        client = openai.OpenAI(base_url=f"{demo.url}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        load = Load(client, model, questions, args.max_tokens)
        pool = ThreadPoolExecutor(args.clients)
        for w in range(args.clients):
            pool.submit(load.client_loop, w, args.clients)
        demo.t0 = time.monotonic()
        demo.event("serving EP4, clients streaming")
        time.sleep(args.phase_s)

        victim = demo.status()["ranks"][2]
        os.kill(victim["pid"], signal.SIGKILL)
        demo.event(f"SIGKILL rank 2 (pid {victim['pid']}) mid-stream")
        demo.wait(lambda s: s["ranks"][2]["state"] == "failed", "rank 2 failed", 30)
        t_fail = demo.event("rank 2 failed; survivors serve its requests")
        # Relaunch rank 2 and start the scale-up ranks together: they load in parallel.
        demo.join("--elastic-ep-join-mode", "recover", "--ranks", "2")
        demo.join("--elastic-ep-join-mode", "scale", "--elastic-ep-join-rank-offset", "4",
                  "--nranks", "2")
        seen = ["failed"]

        def back(st: dict) -> bool:
            if st["ranks"][2]["state"] != seen[-1]:
                seen.append(st["ranks"][2]["state"])
            return seen[-1] == "healthy"

        demo.wait(back, "rank 2 healthy")
        t_back = demo.event(f"rank 2 rejoined ({' -> '.join(seen)})")
        time.sleep(args.phase_s / 2)
        demo.wait(lambda s: all(r["state"] == "ready" for r in s["ranks"][4:6]),
                  "ranks 4,5 ready")
        demo.event("ranks 4,5 loaded (ready)")
        reply = httpx.post(f"{demo.url}/scale_elastic_ep", json={"new_ep_size": 6}, timeout=30)
        reply.raise_for_status()
        demo.event("POST /scale_elastic_ep {new_ep_size: 6}")
        demo.wait(lambda s: healthy_count(s) == 6 and s["scale_phase"] == "idle", "EP6")
        t_ep6 = demo.event("serving EP6")
        time.sleep(args.phase_s)
        load.stop.set()
        pool.shutdown(wait=True)
        t_end = demo.event("clients stopped")
        lost = [r["rank"] for r in demo.status()["ranks"] if r["state"] != "healthy"]
    except (RuntimeError, httpx.HTTPError, openai.OpenAIError, OSError) as exc:
        print(f"demo failed: {exc}\n  logs: {demo.logs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # serve and join run in their own sessions: stop them here
        print("demo interrupted; stopping what it started", file=sys.stderr)
        return 130
    finally:
        if load is not None:
            load.stop.set()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        left = demo.stop_all()
    report(demo, load, [(demo.t0, t_fail, "EP4 healthy"), (t_fail, t_back, "EP3 degraded"),
                        (t_back, t_ep6, "EP4 again"), (t_ep6, t_end, "EP6")])
    print(f"processes left after Ctrl-C: {len(left)}")
    if lost:
        print(f"ranks {lost} were not healthy at the end; see the logs in {demo.logs}")
    return 0 if not load.errors and not left and not lost else 1


def report(demo: Demo, load: Load, phases: list[tuple[float, float, str]]) -> None:
    print("\n== ElasticEP demo ==")
    print(f"{'t (s)':>7}  {'epoch':>5}  {'ep_size':>7}  {'healthy':>7}  event")
    for t, what, epoch, ep_size, healthy in demo.events:
        print(f"{t - demo.t0:7.1f}  {epoch:>5}  {ep_size:>7}  {healthy:>7}  {what}")
    print(f"\nrequests sent {load.sent}, completed {load.completed}, "
          f"errors {len(load.errors)}")
    gap, at = load.max_gap
    print(f"longest gap between two tokens of one stream: {gap:.2f} s "
          f"(ended at t={at - demo.t0:.1f} s); longest wait for a first token: "
          f"{load.max_ttft:.2f} s")
    for t0, t1, name in phases:
        if t1 > t0:
            print(f"tokens/s {name:<13}: {load.tokens_between(t0, t1) / (t1 - t0):7.1f}")
    for err in load.errors[:5]:
        print(f"  error: {err}")


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main() -> int:
    # Explicit handlers: a background job may inherit SIGINT ignored, and SIGTERM must
    # clean up too (serve and join run in their own sessions and would be left behind).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    ap.add_argument("--phase-s", type=float, default=6.0,
                    help="seconds of load between events")
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
