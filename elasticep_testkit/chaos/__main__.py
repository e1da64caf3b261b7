"""`python -m elasticep_testkit.chaos --trials N --seed S`: seeded fault schedules against a real
`elasticep serve` deployment; exit status 1 on any invariant violation (each one
followed by a one-line ``REPRODUCE:`` command), 0 otherwise.

Examples:
  python -m elasticep_testkit.chaos --trials 50 --seed 1
  python -m elasticep_testkit.chaos --trials 2 --seed 3 --heartbeat-timeout 1.0
  python -m elasticep_testkit.chaos --trials 1 --schedule 'kill:ranks=0:at=1.00:p=0.00'
  python -m elasticep_testkit.chaos --trials 4 --seed 1 --nnodes 2   # leader-kill, node-0-host-kill
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
import time

from elasticep_testkit.chaos.runner import ChaosConfig, run
from elasticep_testkit.chaos.schedule import HOST_KINDS, KINDS, Schedule


def parse_args(argv: list[str] | None = None) -> ChaosConfig:
    """The command line as a :class:`ChaosConfig` (exits with status 2 on bad flags)."""
    ap = argparse.ArgumentParser(prog="python -m elasticep_testkit.chaos",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-trial", type=int, default=0, help="replay trial T of a seed")
    ap.add_argument("--schedule", default=None, help="replay this schedule in every trial")
    ap.add_argument("--ep-size", type=int, default=4)
    ap.add_argument("--ep-num-redundant-experts", type=int, default=16)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--concurrency", type=int, default=6, help="streams kept in flight")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kinds", default=None,
                    help=f"fault kinds to draw from (default: {','.join(KINDS)}; with "
                         f"--nnodes 2: {','.join(HOST_KINDS)})")
    ap.add_argument("--max-faults", type=int, default=2, help="most faults per trial")
    ap.add_argument("--nnodes", type=int, choices=(1, 2), default=1,
                    help="2: two nodes with their membership in a 3-member etcd (needs "
                         "the etcd binary), which the host kinds need")
    a = ap.parse_args(argv)
    allowed = HOST_KINDS if a.nnodes == 2 else KINDS
    kinds = tuple(k for k in (a.kinds or ",".join(allowed)).split(",") if k)
    if unknown := set(kinds) - set(allowed):
        ap.error(f"--kinds: {sorted(unknown)} not drawn with --nnodes {a.nnodes}; choose "
                 f"from {','.join(allowed)}")
    if a.schedule:
        try:
            kinds_given = {f.kind for f in Schedule.parse(a.schedule).faults}
        except ValueError as exc:
            ap.error(f"--schedule: {exc}")
        if bad := kinds_given - set(allowed):
            ap.error(f"--schedule: {sorted(bad)} cannot run with --nnodes {a.nnodes}")
    if a.trials < 1 or a.ep_size < 3 or a.max_faults < 1:
        ap.error("need --trials >= 1, --ep-size >= 3, --max-faults >= 1")
    if a.ep_size % a.nnodes:
        ap.error(f"--ep-size ({a.ep_size}) must be a multiple of --nnodes ({a.nnodes})")
    return ChaosConfig(
        trials=a.trials, seed=a.seed, schedule=a.schedule, first_trial=a.first_trial,
        ep_size=a.ep_size, redundant=a.ep_num_redundant_experts,
        heartbeat_timeout_s=a.heartbeat_timeout, device=a.device, concurrency=a.concurrency,
        max_tokens=a.max_tokens, kinds=kinds, max_faults=a.max_faults, nnodes=a.nnodes)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the runner's cleanup


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s chaos %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for sig in (signal.SIGTERM, signal.SIGINT):  # also when started with SIGINT ignored (&)
        signal.signal(sig, _interrupt)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    t0 = time.monotonic()
    results = run(cfg, emit=lambda line: print(line, flush=True))
    bad = sum(bool(r.violations) for r in results)
    print(f"chaos: {len(results)} trials, {bad} with violations, "
          f"{sum(len(r.violations) for r in results)} violations, "
          f"{time.monotonic() - t0:.0f}s (seed {cfg.seed})", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
