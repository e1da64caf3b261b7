"""Kills inside the recovery windows (issue 30, item 3), each case N times on CPU.

Each trial starts a fresh CPU deployment of the demo model (as the EP tests do), makes
one membership change, and kills a rank inside it. It passes when no second rank died
of it, the expected ranks are healthy and routable, and greedy outputs of the 16 GSM8K
prompts equal the ep_size=1 reference (under the tests' near-tie rule). CI runs one
trial of the first three cases (tests/test_ep_admit_fault.py,
tests/test_ep_recovery_windows.py; the chaos run draws the timed ones).

Cases (``--cases``, default all):

* ``scale-up-after-hand-over``: EP4 (capacity 5) scales to 5; rank 3 dies after it
  shared the placement with the joiner, before the joiner's experts arrive
  (``kill:rank=3:admit=1``);
* ``scale-up-before-hand-over``: the same, rank 3 dying once the joiner is a member but
  before the placement is shared (``kill:rank=3:admit_start=1``);
* ``last-survivor-after-hand-over``: EP1 scales to 2 and the only survivor dies right
  after the hand-over (``kill:rank=0:admit=1``): the joiner must rebuild every expert;
* ``rejoin``: EP4, rank 2 is SIGKILLed and relaunched (`join recover`); rank 3 dies in
  the admission of the rejoin (``kill:rank=3:admit=1``);
* ``kill-during-recovery``: EP4, rank 3 is SIGKILLed, and rank 1 ``--gap-s`` after the
  coordinator reported rank 3 failed, while the survivors reconcile;
* ``scale-down``: EP4 scales down to 3 and rank 1 is SIGKILLed ``--gap-s`` after the
  scale request, while rank 3 drains.

Prints one JSON line: ``{"bench": "recovery_windows", "commit", "trials", "cases":
{case: {"passes", "trials", "seconds"}}, "failures": [{"case", "trial", "reason"}]}``.
Exit status 1 if any trial failed.

Usage (from the repository root): python -m bench.recovery_windows [--trials 10]
    [--cases rejoin,scale-down] [--gap-s 0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._commit import commit
from elasticep.membership.transitions import SlotState
from elasticep_testkit.ep import (  # the tests' launch, reference and near-tie rule
    assert_matches_reference,
    generated,
    launch,
    reference,
    worker_log,
)


class _TmpDirs:
    """The one method of pytest's ``tmp_path_factory`` that :func:`launch` uses."""

    def __init__(self, root: Path) -> None:
        self.root, self.n = root, 0

    def mktemp(self, name: str) -> Path:
        self.n += 1
        path = self.root / f"{name}{self.n}"
        path.mkdir()
        return path


def _exits(driver) -> dict[int, int]:
    """How many processes of each slot have exited so far."""
    return {r: len(codes) for r, codes in driver.deployment.exit_codes.items()}


def _check_serving(driver, healthy: list[int], exits_before: dict[int, int],
                   what: str) -> None:
    """``healthy`` are healthy and routable, none of their processes exited since
    ``exits_before`` (:func:`_exits`), and they give the reference outputs."""
    dep = driver.deployment
    dep.wait_healthy(healthy, timeout_s=150)
    driver.wait_routable(healthy, 60)
    died = {r: dep.exit_codes[r] for r in healthy
            if _exits(driver).get(r, 0) > exits_before.get(r, 0)}
    assert not died, f"ranks died of the change: {died} (all exits: {dep.exit_codes})"
    assert_matches_reference(generated(driver), what)


def _wait_state(driver, rank: int, state: SlotState, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while driver.deployment.deployment_status().state_of(rank) != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} not {state.value} after {timeout_s} s")
        time.sleep(0.02)


def _wait_exits(driver, rank: int, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _exits(driver).get(rank, 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: {n} exits not recorded after {timeout_s} s")
        time.sleep(0.02)


def scale_up(tmp: _TmpDirs, fault: str, where: str, _gap_s: float) -> None:
    driver = launch(tmp, ep_num_redundant_experts=16, max_ep_size=5, fault=fault)
    try:
        assert driver.deployment.scale(5, start_joiners=True)["slots"] == [4]
        _check_serving(driver, [0, 1, 2, 4], {}, f"EP4 {{0,1,2,4}} after {fault}")
        log = worker_log(driver)
        assert f"fault injection: rank 3 SIGKILLs itself at {where}" in log, "no kill"
        assert driver.deployment.exit_codes.get(3) == [-9], driver.deployment.exit_codes
    finally:
        driver.close()


def last_survivor(tmp: _TmpDirs, _gap_s: float) -> None:
    driver = launch(tmp, ep_size=1, max_ep_size=2, fault="kill:rank=0:admit=1")
    try:
        assert driver.deployment.scale(2, start_joiners=True)["slots"] == [1]
        _check_serving(driver, [1], {}, "the joiner alone after the last survivor died")
        assert "no active rank is left" not in worker_log(driver)
    finally:
        driver.close()


def rejoin(tmp: _TmpDirs, _gap_s: float) -> None:
    driver = launch(tmp, ep_num_redundant_experts=16, fault="kill:rank=3:admit=1")
    try:
        dep = driver.deployment
        os.kill(dep.pids()[2], signal.SIGKILL)
        _wait_state(driver, 2, SlotState.FAILED)
        _wait_exits(driver, 2, 1)  # the launcher records the exit apart from the coordinator
        before = _exits(driver)
        dep.relaunch(2)
        _check_serving(driver, [0, 1, 2], before, "EP4 {0,1,2} after rank 3 died in 2's "
                       "rejoin")
        assert "fault injection: rank 3 SIGKILLs itself at admission 1" in worker_log(driver)
    finally:
        driver.close()


def _second_fault(tmp: _TmpDirs, gap_s: float, first: Callable[[Any], None],
                  second_rank: int, label: str, after: Callable[[Any], None] | None = None
                  ) -> None:
    """EP4 with redundancy: ``first(driver)`` starts a membership change, ``gap_s``
    later rank ``second_rank`` is SIGKILLed, and ranks {0, 2} must keep serving."""
    driver = launch(tmp, ep_num_redundant_experts=16)
    try:
        victim = driver.deployment.pids()[second_rank]
        first(driver)
        time.sleep(gap_s)
        os.kill(victim, signal.SIGKILL)
        _check_serving(driver, [0, 2], {}, f"EP4 {{0,2}}: rank {second_rank} killed {gap_s} s "
                       f"into {label}")
        if after is not None:
            after(driver)
    finally:
        driver.close()


def kill_during_recovery(tmp: _TmpDirs, gap_s: float) -> None:
    def kill_rank_3(driver) -> None:
        os.kill(driver.deployment.pids()[3], signal.SIGKILL)
        _wait_state(driver, 3, SlotState.FAILED)

    _second_fault(tmp, gap_s, kill_rank_3, 1, "the recovery from rank 3")


def scale_down(tmp: _TmpDirs, gap_s: float) -> None:
    def scale_to_3(driver) -> None:
        assert driver.deployment.scale(3)["slots"] == [3]

    _second_fault(tmp, gap_s, scale_to_3, 1, "the scale-down of rank 3",
                  after=lambda driver: _wait_state(driver, 3, SlotState.FREE))


CASES: dict[str, Callable[[_TmpDirs, float], None]] = {
    "scale-up-after-hand-over":
        lambda tmp, gap: scale_up(tmp, "kill:rank=3:admit=1", "admission 1", gap),
    "scale-up-before-hand-over":
        lambda tmp, gap: scale_up(tmp, "kill:rank=3:admit_start=1",
                                  "the start of admission 1", gap),
    "last-survivor-after-hand-over": last_survivor,
    "rejoin": rejoin,
    "kill-during-recovery": kill_during_recovery,
    "scale-down": scale_down,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.recovery_windows",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10, help="trials per case (default 10)")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of: {', '.join(CASES)} (default: all)")
    ap.add_argument("--gap-s", type=float, default=0.1,
                    help="kill-during-recovery and scale-down: seconds between the first "
                         "event and the kill (default 0.1)")
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown or args.trials < 1:
        ap.error(f"unknown cases {sorted(unknown)}" if unknown else "--trials must be >= 1")
    reference()  # once, before any deployment holds the cores
    out = {"bench": "recovery_windows", "commit": commit(), "trials": args.trials,
           "gap_s": args.gap_s, "cases": {}, "failures": []}
    with tempfile.TemporaryDirectory(prefix="recovery-windows-") as root:
        tmp = _TmpDirs(Path(root))
        for case in cases:
            passes, t0 = 0, time.monotonic()
            for trial in range(args.trials):
                try:
                    CASES[case](tmp, args.gap_s)
                    passes += 1
                except Exception as exc:  # noqa: BLE001 - every failure is a result
                    reason = f"{type(exc).__name__}: {exc}"[:600]
                    out["failures"].append({"case": case, "trial": trial, "reason": reason})
                    print(f"{case} trial {trial}: FAILED {reason}\n{traceback.format_exc()}",
                          file=sys.stderr, flush=True)
                print(f"{case} trial {trial}: {passes} of {trial + 1} passed",
                      file=sys.stderr, flush=True)
            out["cases"][case] = {"passes": passes, "trials": args.trials,
                                  "seconds": round(time.monotonic() - t0, 1)}
    print(json.dumps(out), flush=True)
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
