"""ElasticEP demo (`make demo`): serve through a rank death, a rejoin and a scale-up.

1. starts `elasticep serve` with EP4 on the embedded demo model (16 redundant expert
   slots, capacity for 6 ranks);
2. streams GSM8K questions through the `openai` client from a few concurrent clients;
3. SIGKILLs one rank (pid from /elastic_ep_status) while streams are running, relaunches
   it with `elasticep join ... recover`, then starts two more ranks with
   `elasticep join ... scale` and admits them with POST /scale_elastic_ep;
4. prints requests sent/completed, errors, the longest stream gap, the epoch at each
   event and tokens/s per phase, and stops every process it started.

Runs in about 1-2 minutes on 2 CPU cores. Logs of serve and join go to a temp dir. It
drives the deployment with the test kit's harness (``elasticep_testkit``: the serve
process, the streaming load and its statistics), so it needs ``pip install -e '.[test]'``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # elasticep_testkit lives in the repository, not the wheel

import httpx  # noqa: E402
import openai  # noqa: E402

from elasticep.membership.status import DeploymentStatus  # noqa: E402
from elasticep.membership.transitions import ScalePhase, SlotState  # noqa: E402
from elasticep_testkit.harness import timeline  # noqa: E402
from elasticep_testkit.harness.load import RequestRecord, SteadyLoad, make_client  # noqa: E402
from elasticep_testkit.harness.serve_process import ServeProcess  # noqa: E402
from elasticep_testkit.prompts import gsm8k_prompts  # noqa: E402

SERVE_ARGS = ["--ep-size", "4", "--ep-num-redundant-experts", "16", "--max-ep-size", "6",
              "--heartbeat-timeout", "1.0"]


class Demo:
    """The deployment (the harness' :class:`ServeProcess`) and the event timeline."""

    def __init__(self, serve: ServeProcess) -> None:
        self.serve = serve
        self.events: list[tuple[float, str, int, int, int]] = []
        self.t0 = time.monotonic()

    def join(self, *args: str) -> None:
        print(f"$ elasticep join --dist-init-addr {self.serve.coordinator} {' '.join(args)}",
              flush=True)
        self.serve.join(*args)

    def wait(self, pred, what: str, timeout_s: float = 120) -> DeploymentStatus:
        return self.serve.wait_for(pred, timeout_s, what)

    def event(self, what: str) -> float:
        st = self.serve.status()
        now = time.monotonic()
        self.events.append((now, what, st.epoch, st.ep_size, len(st.healthy_ranks())))
        print(f"  [{now - self.t0:6.1f} s] epoch {st.epoch:>2}  {what}", flush=True)
        return now


def run(args: argparse.Namespace) -> int:
    print(f"$ elasticep serve {' '.join(SERVE_ARGS)}", flush=True)
    try:
        serve = ServeProcess.start(SERVE_ARGS)
    except (RuntimeError, TimeoutError) as exc:
        print(f"demo failed: serve did not start: {exc}", file=sys.stderr)
        return 1
    print(f"  (logs in {serve.log_path.parent})\n  "
          f"{next(ln for ln in serve.tail(1 << 20).splitlines() if ln.startswith('ready'))}",
          flush=True)
    demo = Demo(serve)
    load = None
    records: list[RequestRecord] = []
    lost: list[int] = []
    try:
        load = SteadyLoad(make_client(serve.url, 120), serve.model_name(), gsm8k_prompts(64),
                          args.clients, args.max_tokens)
        demo.t0 = time.monotonic()
        demo.event("serving EP4, clients streaming")
        time.sleep(args.phase_s)

        victim = serve.status().rank(2)
        os.kill(victim.pid, signal.SIGKILL)
        demo.event(f"SIGKILL rank 2 (pid {victim.pid}) mid-stream")
        demo.wait(lambda s: s.state_of(2) == SlotState.FAILED, "rank 2 failed", 30)
        t_fail = demo.event("rank 2 failed; survivors serve its requests")
        # Relaunch rank 2 and start the scale-up ranks together: they load in parallel.
        demo.join("--elastic-ep-join-mode", "recover", "--ranks", "2")
        demo.join("--elastic-ep-join-mode", "scale", "--elastic-ep-join-rank-offset", "4",
                  "--nranks", "2")
        seen = [SlotState.FAILED.value]

        def back(st: DeploymentStatus) -> bool:
            if st.state_of(2) != seen[-1]:
                seen.append(st.state_of(2).value)
            return seen[-1] == SlotState.HEALTHY

        demo.wait(back, "rank 2 healthy")
        t_back = demo.event(f"rank 2 rejoined ({' -> '.join(seen)})")
        time.sleep(args.phase_s / 2)
        demo.wait(lambda s: all(s.state_of(r) == SlotState.READY for r in (4, 5)),
                  "ranks 4,5 ready")
        demo.event("ranks 4,5 loaded (ready)")
        code, body = serve.scale(6)
        if code != 200:
            raise RuntimeError(f"POST /scale_elastic_ep 6 -> {code} {body}")
        demo.event("POST /scale_elastic_ep {new_ep_size: 6}")
        demo.wait(lambda s: len(s.healthy_ranks()) == 6 and s.scale_phase == ScalePhase.IDLE,
                  "EP6")
        t_ep6 = demo.event("serving EP6")
        time.sleep(args.phase_s)
        records = load.stop(timeout_s=120)
        load = None
        t_end = demo.event("clients stopped")
        lost = [r.rank for r in serve.status().ranks if r.state != SlotState.HEALTHY]
    except (RuntimeError, TimeoutError, httpx.HTTPError, openai.OpenAIError, OSError) as exc:
        print(f"demo failed: {exc}\n  logs: {serve.log_path.parent}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # serve and join run in their own sessions: stop them here
        print("demo interrupted; stopping what it started", file=sys.stderr)
        return 130
    finally:
        if load is not None:
            records = load.stop(timeout_s=120)
        left = serve.stop()
    report(demo, records, [(demo.t0, t_fail, "EP4 healthy"), (t_fail, t_back, "EP3 degraded"),
                           (t_back, t_ep6, "EP4 again"), (t_ep6, t_end, "EP6")])
    errors = [r.error for r in records if r.error]
    print(f"processes left after Ctrl-C: {len(left)}")
    if lost:
        print(f"ranks {lost} were not healthy at the end; see the logs in "
              f"{serve.log_path.parent}")
    return 0 if not errors and not left and not lost else 1


def report(demo: Demo, records: list[RequestRecord],
           phases: list[tuple[float, float, str]]) -> None:
    print("\n== ElasticEP demo ==")
    print(f"{'t (s)':>7}  {'epoch':>5}  {'ep_size':>7}  {'healthy':>7}  event")
    for t, what, epoch, ep_size, healthy in demo.events:
        print(f"{t - demo.t0:7.1f}  {epoch:>5}  {ep_size:>7}  {healthy:>7}  {what}")
    errors = [r.error for r in records if r.error]
    print(f"\nrequests sent {len(records)}, completed {len(records) - len(errors)}, "
          f"errors {len(errors)}")
    gap, at = max(((b - a, b) for a, b in timeline.gaps(records)), default=(0.0, demo.t0))
    ttft = max((r.token_times[0] - r.start for r in records if r.token_times), default=0.0)
    print(f"longest gap between two tokens of one stream: {gap:.2f} s "
          f"(ended at t={at - demo.t0:.1f} s); longest wait for a first token: "
          f"{ttft:.2f} s")
    for t0, t1, name in phases:
        if t1 > t0:
            print(f"tokens/s {name:<13}: {timeline.tokens_per_s(records, t0, t1):7.1f}")
    for err in errors[:5]:
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
