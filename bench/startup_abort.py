"""How `elasticep serve` ends when a rank dies while loading (issue 17, item 9), N times.

Each run starts ``serve --ep-size E`` on free loopback ports with
``ELASTICEP_FAULT=kill:rank=1:loading`` (rank 1 SIGKILLs itself once its weights are read,
before it registers) through ``elasticep_testkit.native_thread_cli``, and records serve's
exit status, whether it aborted ("terminate called ..." in its stderr, or status -6),
and whether its error lines are exactly the expected one.

Usage: python -m bench.startup_abort [--runs 30] [--ep-size 2] [--exit console|sys]
       [--no-thread]

``--exit sys`` ends serve as before the fix (``sys.exit(main())``, a normal interpreter
exit); ``--no-thread`` leaves out the extra daemon thread in native code (see
``native_thread_cli``). Prints one JSON line: runs, aborted, statuses (status -> count),
expected_line (runs whose only error line was the expected one), seconds (median per
run), and the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

EXPECTED = "elasticep serve: error: rank 1 exited with -9 while loading; its log ends with:"


def one_run(ep_size: int, exit_mode: str, thread: bool) -> tuple[int, bool, bool, float]:
    """(status, aborted, only the expected error line, seconds) of one serve run."""
    cmd = [sys.executable, "-m", "elasticep_testkit.native_thread_cli", "--exit", exit_mode,
           *([] if thread else ["--no-thread"]), "serve", "--ep-size", str(ep_size),
           "--port", "0", "--dist-init-addr", "127.0.0.1:0",
           "--log-dir", tempfile.mkdtemp(prefix="elasticep-startup-abort-")]
    env = {**os.environ, "ELASTICEP_FAULT": "kill:rank=1:loading"}
    t0 = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    aborted = "terminate called" in run.stderr or run.returncode == -6
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    return run.returncode, aborted, errors == [EXPECTED], time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--ep-size", type=int, default=2)
    ap.add_argument("--exit", choices=("console", "sys"), default="console")
    ap.add_argument("--no-thread", action="store_true")
    args = ap.parse_args()
    results = [one_run(args.ep_size, args.exit, not args.no_thread) for _ in range(args.runs)]
    print(json.dumps({
        "runs": args.runs, "aborted": sum(r[1] for r in results),
        "statuses": dict(Counter(str(r[0]) for r in results)),
        "expected_line": sum(r[2] for r in results),
        "seconds": round(statistics.median(r[3] for r in results), 1),
        "ep_size": args.ep_size, "exit": args.exit, "thread": not args.no_thread}))


if __name__ == "__main__":
    main()
