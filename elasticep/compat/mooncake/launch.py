"""The coordinator of a Mooncake-style start-up, in a detached process of its own.

Mooncake users start ranks with a plain ``dist.init_process_group(backend="mooncake",
init_method="env://")``: nobody hands in a coordinator address. The first rank to
create WORLD starts the coordinator here, in its own session (so it outlives every
rank, rank 0 included), and publishes its address in torch's rendezvous store; later
ranks and joiners read it there. The coordinator exits once ranks have registered and
none has been alive for `IDLE_EXIT_S`, or when none registered within
`START_TIMEOUT_S`.

Run as ``python -m elasticep.compat.mooncake.launch --host H``: prints the address on
stdout, then serves.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ADDRESS_KEY = "elasticep/mooncake/coordinator"
IDLE_EXIT_S = 3.0
START_TIMEOUT_S = 300.0
# Ranks of these tests share few cores: a heartbeat may be late by seconds while a
# neighbour imports torch. Deaths are still seen at once through the control socket.
HB_TIMEOUT_S = 10.0


def coordinator_address(store, host: str, timeout_s: float) -> str:
    """The coordinator of this rendezvous: started here if this rank comes first.

    Args:
        store: torch's rendezvous store of WORLD (shared by every rank and joiner).
        host: interface the coordinator binds and advertises.
        timeout_s: how long to wait for another rank's coordinator (seconds).
    Raises:
        RuntimeError: the coordinator process could not start.
        TimeoutError / RuntimeError (torch): no address appeared within timeout_s.
    """
    if store.add(ADDRESS_KEY + "/starter", 1) == 1:
        store.set(ADDRESS_KEY, start_detached(host))
    store.wait([ADDRESS_KEY], timedelta(seconds=timeout_s))
    return store.get(ADDRESS_KEY).decode()


def start_detached(host: str) -> str:
    """Start a coordinator process in its own session; returns its ``"host:port"``.

    Raises:
        RuntimeError: it exited before printing its address.
    """
    import elasticep

    root = str(Path(elasticep.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "elasticep.compat.mooncake.launch",
                             "--host", host], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    line = proc.stdout.readline().decode().strip()
    proc.stdout.close()
    if not line:
        raise RuntimeError(f"the elastic coordinator (pid {proc.pid}) exited before it "
                           f"printed its address (exit code {proc.poll()})")
    return line


def main(argv: list[str] | None = None) -> None:
    """Serve a coordinator until it is idle (see the module docstring)."""
    ap = argparse.ArgumentParser(description="detached elastic coordinator for mooncake PG")
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args(argv)
    from elasticep.membership import CoordinatorClient, start_coordinator

    coord = start_coordinator(args.host, 0, hb_timeout_s=HB_TIMEOUT_S)
    print(coord.address, flush=True)
    sys.stdout = open(os.devnull, "w")  # the reader closed the pipe
    client = CoordinatorClient(coord.address)
    started = idle_since = time.monotonic()
    seen = False  # some rank has registered (the registry keeps dead ranks, marked so)
    while True:
        time.sleep(0.5)
        now = time.monotonic()
        ranks = client.status()["ranks"]
        # Short-lived ranks may register and exit between two polls: registration, not
        # a poll that caught a rank alive, is what proves the coordinator was used.
        if any(r["alive"] for r in ranks.values()) or (ranks and not seen):
            idle_since = now
        seen = seen or bool(ranks)
        if (seen and now - idle_since > IDLE_EXIT_S) or (
                not seen and now - started > START_TIMEOUT_S):
            break
    client.close()
    coord.close()


if __name__ == "__main__":
    main()
