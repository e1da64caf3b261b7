"""Lab tool (not product code): the stub server of ``bench.serving --launch
--stub-engine-steps-per-s`` with per-request stamps, for joining with the client's.

Adds, per /v1/completions request: when uvicorn's h11 protocol saw its connection
(``conn``), when the ASGI app was entered (``asgi``), and the front-end's own first-token
stamps (``arrived`` .. ``written``, CLOCK_MONOTONIC microseconds), keyed by the client's
port; each ``GET /debug/first_token_trace`` appends them, with the process's CPU
seconds, as one JSON line to ``$STAMPS_OUT``. ``$STAMPS_INLINE_CHARS`` overrides the
front-end's inline-tokenize limit (the A/B's "before" sets main's 1024).
"""
import json
import os
import resource
import sys

import uvicorn.protocols.http.h11_impl as h11i

from elasticep.frontend import first_token_trace as ftt
from elasticep.frontend import http_server, openai_serving
from elasticep.frontend_link import monotonic_us

OUT = os.environ["STAMPS_OUT"]
if os.environ.get("STAMPS_INLINE_CHARS"):
    openai_serving.INLINE_PROMPT_CHARS = int(os.environ["STAMPS_INLINE_CHARS"])
conn, asgi, ids, raw = {}, {}, {}, {}

_connection_made = h11i.H11Protocol.connection_made


def connection_made(self, transport):
    peer = transport.get_extra_info("peername")
    if peer:
        conn[peer[1]] = monotonic_us()
    return _connection_made(self, transport)


h11i.H11Protocol.connection_made = connection_made
_build_app = http_server.build_app


def build_app(*args, **kwargs):
    app = _build_app(*args, **kwargs)

    async def stamped(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await app(scope, receive, send)
        port = scope["client"][1]
        asgi[port] = monotonic_us()
        seen = [False]

        async def send_noting_id(msg):
            body = msg.get("body") or b""
            i = body.find(b'"id":"') if not seen[0] else -1
            if i >= 0:
                seen[0] = True
                ids[body[i + 6:body.index(b'"', i + 6)].decode()] = port
            await send(msg)
        return await app(scope, receive, send_noting_id)
    return stamped


http_server.build_app = build_app
_finish = ftt.FirstTokenTrace._finish


def finish(self, rid):
    s = self._open.get(rid)
    if s is not None and s.rank is not None:
        raw[rid] = dict(arrived=s.arrived, tokenized=s.tokenized, routed=s.routed,
                        published=s.published, frontend=s.frontend, delivered=s.delivered,
                        written=s.written)
    return _finish(self, rid)


ftt.FirstTokenTrace._finish = finish
_summary = ftt.FirstTokenTrace.summary


def summary(self, reset=False):
    rows = [dict(id=rid, port=ids.get(rid), conn=conn.get(ids.get(rid)),
                 asgi=asgi.get(ids.get(rid)), **st) for rid, st in raw.items()]
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open(OUT, "a") as f:
        f.write(json.dumps({"reset": reset, "cpu_s": ru.ru_utime + ru.ru_stime,
                            "rows": rows}) + "\n")
    raw.clear()
    ids.clear()
    return _summary(self, reset)


ftt.FirstTokenTrace.summary = summary

if __name__ == "__main__":  # the stub ranks are spawned: they import this file again
    from elasticep_testkit.serving import stub_serve
    sys.exit(stub_serve.main(sys.argv[1:]))
