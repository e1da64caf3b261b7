"""Lab tool (not product code): ``python -m bench.serving`` whose client notes, per
request, when it opened its connection, when that was connected, when the request was
sent and when the first token's chunk arrived (perf_counter: CLOCK_MONOTONIC on Linux,
the server's stamp clock), keyed by its local port, into ``$STAMPS_OUT.client``; with
``--launch --stub-engine-steps-per-s`` the server is :mod:`stamps_serve`.
Run from the repository root: ``python docs/results/cpu-i50f/tools/stamps_bench.py ARGS``.
"""
import asyncio
import atexit
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from elasticep_testkit.serving import client, stub_engine  # noqa: E402

rows = []
_open_connection = asyncio.open_connection


async def open_connection(host, port, **kw):
    t0 = time.perf_counter()
    reader, writer = await _open_connection(host, port, **kw)
    row = dict(port=writer.get_extra_info("sockname")[1], open=t0,
               connected=time.perf_counter())
    rows.append(row)
    reader.stamps = row
    drain = writer.drain

    async def drained():
        await drain()
        row.setdefault("sent", time.perf_counter())
    writer.drain = drained
    return reader, writer


asyncio.open_connection = open_connection
_read_body = client._read_body


async def read_body(reader, headers):
    row = getattr(reader, "stamps", {})
    async for piece in _read_body(reader, headers):
        if "first_piece" not in row and b'"text"' in piece:
            row["first_piece"] = time.perf_counter()
        yield piece


client._read_body = read_body
SERVE = str(Path(__file__).with_name("stamps_serve.py"))
stub_engine.server_command = lambda s: (sys.executable, SERVE, "--stub-engine-steps-per-s",
                                        repr(s))
atexit.register(lambda: Path(os.environ["STAMPS_OUT"] + ".client").write_text(
    json.dumps(rows)))
from bench import serving  # noqa: E402

sys.exit(serving.main(sys.argv[1:]))
