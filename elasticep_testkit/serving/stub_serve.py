"""``python -m elasticep_testkit.serving.stub_serve``: the real HTTP front-end (FastAPI
app, SSE, detokenization, request tracking, the zmq transport) over stub ranks that emit
tokens at a set rate (:mod:`elasticep_testkit.serving.stub_engine`), so that the
front-end's ceiling is measured alone.

It takes serve's --model, --host, --port, --log-dir, --api-server-count and --ep-size
(the number of stub rank processes), and accepts serve's --dist-init-addr, --device, --dtype, --load-format
and --disable-cuda-graph without using them (no model is loaded: only the tokenizer),
so that ``ServeProcess.start(..., program=stub_engine.server_command(S))`` drives it as
it drives serve. It prints the same ``ready: URL`` line and stops on SIGINT/SIGTERM,
ending its rank processes. ``--api-server-stall-timeout-s`` sets the extra front-end
processes' stall timeout (serve keeps the pool's default), so that a test of a stalled
process need not wait that long.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

from elasticep.frontend.loop_beats import BEAT_S, STALL_TIMEOUT_S
from elasticep.frontend.membership_source import ConnectedWorkers
from elasticep.frontend_link import FrontendChannel, WorkerHello
from elasticep.utils.net import bind_tcp
from elasticep.utils.startup_heap import freeze_startup_heap, thaw_startup_heap
from elasticep.utils.wait import wait_until
from elasticep_testkit.serving.stub_engine import rank_main

READY_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags (see the module doc)."""
    ap = argparse.ArgumentParser(prog="python -m elasticep_testkit.serving.stub_serve",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--stub-engine-steps-per-s", type=float, required=True,
                    help="steps per second of each stub rank (one token per running "
                         "request per step)")
    ap.add_argument("--model", required=True, help="model dir (its tokenizer is used)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--ep-size", type=int, default=1, help="stub rank processes")
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="the API's context limit, as serve's")
    ap.add_argument("--api-server-count", type=int, default=1,
                    help="HTTP front-end processes sharing --port, as serve's")
    ap.add_argument("--api-server-stall-timeout-s", type=float, default=STALL_TIMEOUT_S,
                    help="seconds an extra front-end process's event loop may go without "
                         "a beat before it is killed and relaunched")
    for unused in ("--dist-init-addr", "--device", "--dtype", "--load-format"):
        ap.add_argument(unused, default=None, help="accepted for serve's sake; unused")
    ap.add_argument("--disable-cuda-graph", action="store_true", help="unused")
    args = ap.parse_args(argv)
    if args.stub_engine_steps_per_s <= 0:
        ap.error("--stub-engine-steps-per-s must be > 0")
    if args.ep_size < 1:
        ap.error("--ep-size must be >= 1")
    if args.api_server_count < 1:
        ap.error("--api-server-count must be >= 1")
    if not args.api_server_stall_timeout_s > BEAT_S:
        ap.error(f"--api-server-stall-timeout-s must be > {BEAT_S}")
    return args


def stub_membership(ep_size: int, connected: Callable[[], Mapping[int, WorkerHello]],
                    ) -> ConnectedWorkers:
    """A front-end process's membership: the stub ranks that said hello on its link."""
    return ConnectedWorkers(connected, ep_size)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(levelname)s %(message)s")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="elasticep-stub-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # imported here, not at the top: each spawned stub rank imports this module again,
    # and the front-end's imports (torch among them) would cost it seconds of CPU
    from elasticep.frontend.api_server_pool import ApiServerPool
    from elasticep.frontend.api_server_proc import ApiServerSpec
    from elasticep.frontend.http_server import create_server

    channel = FrontendChannel(host=args.host)
    kwargs = {"served_model_name": args.model, "host": args.host, "port": args.port,
              "max_total_tokens": args.max_total_tokens}
    sock = bind_tcp(args.host, args.port)
    pool, links = None, [channel.endpoints]
    if args.api_server_count > 1:  # before the front-end: its metrics go multiprocess
        pool = ApiServerPool(args.api_server_count - 1, args.host, sock, 5.0,
                             stall_timeout_s=args.api_server_stall_timeout_s)
        links += pool.start()
    server, frontend = create_server(
        args.model, channel, stub_membership(args.ep_size, lambda: channel.connected),
        sock=sock, **kwargs)
    ctx = multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=rank_main, name=f"stub-rank{r}",
                         args=(r, links, args.stub_engine_steps_per_s,
                               str(log_dir), os.getpid()))
             for r in range(args.ep_size)]
    server.start()
    if pool is not None:
        pool.serve(ApiServerSpec(args.model, partial(stub_membership, args.ep_size), kwargs,
                                 ranks=args.ep_size), on_death=frontend.abort_origin)
    try:
        for p in ranks:
            p.start()
        wait_until(lambda: len(channel.connected) >= args.ep_size or stop.is_set(),
                   READY_TIMEOUT_S, "the stub ranks to connect", poll_s=0.05)
        if pool is not None:
            pool.wait_serving()
        if not stop.is_set():
            freeze_startup_heap()  # as serve's front-end does
            print(f"ready: {server.url} (stub engine, {args.ep_size} ranks at "
                  f"{args.stub_engine_steps_per_s:g} steps/s)", flush=True)
        stop.wait()
        return 0
    finally:
        if pool is not None:
            pool.signal_stop()
        server.stop()
        if pool is not None:
            pool.stop()
        for p in ranks:
            if p.is_alive():
                p.terminate()  # SIGTERM to this pid only: the rank writes its stats
        for p in ranks:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        channel.close()
        thaw_startup_heap()  # this process ends with a normal interpreter exit


if __name__ == "__main__":
    sys.exit(main())
