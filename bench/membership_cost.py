"""What keeping the membership in etcd costs when nothing fails over (issue 46): one
single-node `elasticep serve` deployment with ``--membership-store etcd://`` (a
3-member etcd on 127.0.0.1, ``elasticep_testkit.etcd_cluster``) against the same
deployment with the embedded coordinator, same model, flags and load.

- tokens/s: steady greedy streams, ``--repeats`` A/B pairs alternating the order (as
  ``bench.overhead``: both deployments stay up, the idle one waits);
- the commit latency of a recovery: ``--kills`` times per deployment, the last rank's
  worker is SIGKILLed (``--restart-failed-ranks`` relaunches it, and the next kill waits
  until it is readmitted); the latency is from the kill to the first survivor's log
  line of the failure epoch's commit (the ranks' log timestamps, milliseconds). With
  etcd that commit waits for the store (``membership/commit_gate.py``): one etcd round
  trip more than embedded.

Usage: python -m bench.membership_cost [--repeats 3] [--window-s 8] [--kills 3]
       [--ep-size 4] [--concurrency 8] [--max-tokens 64]

Prints two JSON lines (``metric``: ``tokens_per_s``, ``recovery_commit_s``), each with
both deployments' figures (medians with the runs), commit, machine. CPU only needs no
GPU (``--device cpu``, the default).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
from datetime import datetime

from bench._commit import commit
from bench._deploy import add_deploy_arguments, deployment_args, machine
from bench.overhead import measure
from elasticep.utils.wait import wait_until
from elasticep_testkit.etcd_cluster import EtcdCluster
from elasticep_testkit.harness.serve_process import ServeProcess, all_healthy
from elasticep_testkit.prompts import gsm8k_prompts

STORES = ("etcd", "embedded")
READMIT_TIMEOUT_S = 180.0  # a relaunched rank loads its weights and is readmitted
# a rank's log line for a failure epoch's commit (elastic/log_context.py's format,
# distributed/state.py's message); the time stamp is local time, milliseconds
FAILURE_COMMIT = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*: commit failure ", re.MULTILINE)


def failure_commits(log: str) -> list[float]:
    """The wall-clock times (``time.time()`` seconds) of the failure-epoch commits a
    rank's log shows."""
    return [datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for t in FAILURE_COMMIT.findall(log)]


def recovery_commit_s(serve: ServeProcess, victim: int, ranks: int) -> float:
    """SIGKILL ``victim``'s worker, then wait for a survivor's commit of the failure
    epoch and for the relaunched rank's readmission; the seconds from the kill to that
    commit.

    Raises:
        TimeoutError: no commit within 30 s, or no readmission in time.
    """
    survivors = [r for r in range(ranks) if r != victim]
    pid = serve.signal_rank(victim, signal.SIGKILL)
    killed = time.time()

    def committed() -> float | None:
        after = [t for r in survivors for t in failure_commits(serve.rank_log(r))
                 if t >= killed - 0.001]  # (the stamps are truncated to milliseconds)
        return min(after) if after else None

    at = wait_until(committed, 30, f"a commit without rank {victim}", poll_s=0.05)
    serve.wait_for(lambda st: all_healthy(st) and st.rank(victim).pid not in (None, pid),
                   READMIT_TIMEOUT_S, f"rank {victim} relaunched and readmitted", poll_s=0.2)
    return max(0.0, at - killed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="A/B pairs of the tokens/s")
    ap.add_argument("--window-s", type=float, default=8.0, help="measured seconds per run")
    ap.add_argument("--kills", type=int, default=3, help="rank kills per deployment")
    add_deploy_arguments(ap)
    args = ap.parse_args()
    if args.repeats < 1 or args.kills < 1:
        ap.error("--repeats and --kills must be at least 1")
    prompts = gsm8k_prompts(args.num_prompts)
    common = [*deployment_args(args), "--restart-failed-ranks"]
    serves: dict[str, ServeProcess] = {}
    tps: dict[str, list[float]] = {s: [] for s in STORES}
    texts: dict[str, dict[int, str]] = {s: {} for s in STORES}
    commits: dict[str, list[float]] = {s: [] for s in STORES}
    orphans: list[int] = []
    with EtcdCluster.start(3) as cluster:
        try:
            serves["etcd"] = ServeProcess.start(
                [*common, "--membership-store", f"{cluster.url}/membership-cost"])
            serves["embedded"] = ServeProcess.start(common)
            for rep in range(args.repeats):
                for s in STORES if rep % 2 == 0 else STORES[::-1]:
                    rate, done = measure(serves[s], prompts, args)
                    tps[s].append(rate)
                    texts[s].update(done)
            for _ in range(args.kills):
                for s in STORES:
                    commits[s].append(recovery_commit_s(serves[s], args.ep_size - 1,
                                                        args.ep_size))
        finally:
            for s in serves.values():
                orphans += s.stop()

    def summary(xs: list[float], digits: int) -> dict:
        return {"median": round(statistics.median(xs), digits),
                "runs": [round(x, digits) for x in xs]}

    same = sorted(set(texts["etcd"]) & set(texts["embedded"]))
    meta = {"commit": commit(), "ep_size": args.ep_size, "device": args.device,
            "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "orphans": orphans, "machine": machine(), "cpus": os.cpu_count()}
    print(json.dumps({
        "bench": "membership_cost", "metric": "tokens_per_s",
        "etcd": summary(tps["etcd"], 1), "embedded": summary(tps["embedded"], 1),
        "ratio": round(statistics.median(tps["etcd"]) / statistics.median(tps["embedded"]), 3),
        "outputs_identical": all(texts["etcd"][i] == texts["embedded"][i] for i in same),
        "compared_prompts": len(same), "repeats": args.repeats, "window_s": args.window_s,
        **meta}), flush=True)
    print(json.dumps({
        "bench": "membership_cost", "metric": "recovery_commit_s",
        "etcd": summary(commits["etcd"], 3), "embedded": summary(commits["embedded"], 3),
        "kills": args.kills, "victim": args.ep_size - 1, **meta}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
