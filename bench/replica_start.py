"""How soon a fresh standby coordinator replica is elected, and serves, when the leader
key is vacant (issue 46): what a second leader kill waits for while the first kill's
replacement is still starting.

On a 3-member etcd cluster on 127.0.0.1 (``elasticep_testkit.etcd_cluster``), each run
spawns a standby replica (``CoordinatorProcess.start(standby=True)``, a fresh
interpreter, as ``serve`` replaces a dead one) on a prefix no leader holds, and records
elected_s, from the spawn until etcd's ``leader`` key names it, and serve_s, until its
ready line (its rendezvous store up, serving). torch_import_s is ``import
torch.distributed`` in a fresh interpreter, once per run (the rendezvous TCPStore needs
it). ``--tree DIR`` (repeatable) runs the replica's code from each source tree in turn
(the child's ``PYTHONPATH``), interleaved run by run, for an A/B on one machine.

Usage: python -m bench.replica_start [--runs 5] [--heartbeat-timeout 2] [--tree DIR ...]

Prints one JSON line: runs, per tree its elected_s / serve_s (median and max),
torch_import_s (median and max), loadavg (1 min, at the start), commit, cpus.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

from bench._commit import REPO, commit
from elasticep.membership.election import find_leader
from elasticep.membership.etcd_store import EtcdMembershipStore
from elasticep.membership.process import CoordinatorProcess
from elasticep.membership.store import parse_store_url
from elasticep.utils.wait import wait_until
from elasticep_testkit.etcd_cluster import EtcdCluster


def start_s(cluster: EtcdCluster, hb_timeout_s: float) -> tuple[float, float]:
    """(elected_s, serve_s) of a standby spawned with the leader key vacant."""
    url = f"{cluster.url}/bench-{uuid.uuid4().hex[:8]}"
    store = EtcdMembershipStore(parse_store_url(url))
    t0 = time.monotonic()
    replica = CoordinatorProcess.start("127.0.0.1", 0, hb_timeout_s=hb_timeout_s,
                                       membership_store=url, standby=True)
    try:
        wait_until(lambda: _leader(store) == replica.address, 120, "the standby elected",
                   poll_s=0.01)
        elected = time.monotonic() - t0
        wait_until(lambda: replica.leads, 120, "the standby serving", poll_s=0.01)
        return elected, time.monotonic() - t0
    finally:
        replica.close()
        store.close()


def _leader(store: EtcdMembershipStore) -> str | None:
    try:
        return find_leader(store, 0.0)
    except TimeoutError:
        return None


def torch_import_s() -> float:
    """``import torch.distributed`` in a fresh interpreter (seconds)."""
    out = subprocess.run([sys.executable, "-c", "import time; t = time.monotonic(); "
                          "import torch.distributed; print(time.monotonic() - t)"],
                         capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout)


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0)
    ap.add_argument("--tree", action="append", default=None,
                    help="a source tree whose replica code to run (repeatable; "
                    "default: this one)")
    args = ap.parse_args()
    trees = args.tree or [str(REPO)]
    load = os.getloadavg()[0]
    times: dict[str, list[tuple[float, float]]] = {t: [] for t in trees}
    imp = []
    with EtcdCluster.start(3) as cluster:
        for _ in range(args.runs):
            for tree in trees:
                os.environ["PYTHONPATH"] = tree  # the replica child inherits it
                times[tree].append(start_s(cluster, args.heartbeat_timeout))
            imp.append(torch_import_s())
    print(json.dumps({
        "bench": "replica_start", "runs": args.runs,
        "trees": {t: {"elected_s": _stats([e for e, _ in v]),
                      "serve_s": _stats([s for _, s in v])} for t, v in times.items()},
        "torch_import_s": _stats(imp), "loadavg": round(load, 2), "commit": commit(),
        "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
