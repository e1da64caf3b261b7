"""Run an `elasticep` command while another thread of its process is in native code.

    python -m elasticep_testkit.native_thread_cli [--exit console|sys] [--no-thread]
        COMMAND [ARGS...]

One daemon thread loops on a torch.distributed TCPStore call (a C++ round trip made
with the GIL released), so at any moment it is almost surely inside C++. When
`elasticep serve` was reported to die with "terminate called without an active
exception" (issue 17, item 9), serve's launcher threads made such store calls; a process
that leaves through a normal interpreter exit unwinds a thread like that through a
``noexcept`` C++ frame and aborts (status -6). This module reproduces that state on
demand, for ``tests/test_serve_startup.py`` and ``bench/startup_abort.py``.

``--exit console`` (default) leaves the way the installed command does
(:func:`elasticep.entrypoints.cli.console_main`); ``--exit sys`` the way it did before
the fix: ``sys.exit(main())`` and a normal interpreter exit. ``--no-thread`` runs the
command without the extra thread (the command's own threads only).
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta

import torch.distributed as dist

from elasticep.entrypoints import cli


def start_native_thread() -> None:
    """Start the daemon thread that keeps calling into C++ with the GIL released."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                           timeout=timedelta(seconds=60))

    def loop() -> None:
        while True:
            client.check(["never-set"])

    threading.Thread(target=loop, daemon=True, name="native-store-calls").start()
    start_native_thread.keep = (server, client)  # alive until the process ends


def main(argv: list[str]) -> None:
    """Parse ``[--exit console|sys] [--no-thread]``, start the thread, run the command;
    never returns."""
    exit_mode = "console"
    if argv[:1] == ["--exit"]:
        exit_mode, argv = argv[1], argv[2:]
        if exit_mode not in ("console", "sys"):
            sys.exit(f"--exit must be console or sys, got {exit_mode!r}")
    if argv[:1] == ["--no-thread"]:
        argv = argv[1:]
    else:
        start_native_thread()
    sys.argv = ["elasticep", *argv]
    if exit_mode == "sys":
        sys.exit(cli.main())
    cli.console_main()


if __name__ == "__main__":
    main(sys.argv[1:])
