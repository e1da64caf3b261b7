"""`CoordinatorClient`: the supervisor's (launcher / front-end) view of the coordinator.

It needs no torch.distributed: one request/response connection.

    c = CoordinatorClient("127.0.0.1:29400")
    c.status()                      # membership: epochs, per-slot states, pids
    c.report_death(2, pid=1234)     # the launcher's waitpid saw rank 2 exit
    c.request_admission([4, 5])     # ask ranks to admit ready slots at a step boundary
    c.request_deactivation([5])     # mark slot 5 draining; ranks remove it when ready
"""

from __future__ import annotations

import itertools

from .protocol import connect


class CoordinatorClient:
    """Synchronous supervisor client. Every call has a timeout (seconds).

    Raises (all methods): ValueError if the coordinator refuses, TimeoutError /
    ConnectionError if it is unreachable.
    """

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.conn = connect(address, timeout_s)
        self.conn.sock.settimeout(timeout_s)
        self._ids = itertools.count(1)
        # port of the coordinator's rendezvous TCPStore (on the coordinator's host)
        self.store_port: int = int(self._call({"t": "hello", "role": "supervisor"})["store_port"])

    def _call(self, msg: dict) -> dict:
        rid = next(self._ids)
        if not self.conn.send({**msg, "id": rid}):
            raise ConnectionError("coordinator connection closed")
        while True:
            reply = self.conn.recv()
            if reply is None:
                raise ConnectionError("coordinator connection closed or timed out")
            if reply.get("id") == rid:
                break
        if not reply.get("ok"):
            raise ValueError(reply.get("error", "refused"))
        return reply

    def status(self) -> dict:
        """Membership snapshot.

        Returns:
            {"max_world_size": int, "ranks": {"<rank>": {"pid": int, "alive": bool}},
             "groups": {name: {"epoch", "active", "states", "ranks", "on_failure",
                               "requests", "transition"}}}; WORLD is named "world".
        """
        r = self._call({"t": "status"})
        return {k: r[k] for k in ("max_world_size", "ranks", "groups")}

    def report_death(self, rank: int, pid: int | None = None) -> None:
        """Declare global rank `rank` dead (e.g. waitpid returned). With `pid`, only if
        that pid still holds the slot, so a late report cannot kill a relaunched rank."""
        self._call({"t": "report_death", "rank": rank, "pid": pid})

    def request_admission(self, ranks: list[int], group: str = "world") -> None:
        """Ask the members to admit these slots (visible via get_pending_requests)."""
        self._call({"t": "request_admission", "group": group, "ranks": list(ranks)})

    def request_deactivation(self, ranks: list[int], group: str = "world") -> None:
        """Mark these slots draining and ask the members to remove them."""
        self._call({"t": "request_deactivation", "group": group, "ranks": list(ranks)})

    def close(self) -> None:
        self.conn.close()
