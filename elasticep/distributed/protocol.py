"""Control-plane wire format: newline-delimited JSON objects over TCP.

Every message is a dict with a type field ``"t"``. Requests that expect a reply carry an
``"id"``; the reply is ``{"t": "reply", "id": same, "ok": bool, ...}`` (``"error"``
holds the reason when ``ok`` is False). Pushes from the coordinator have no id.

Rank -> coordinator: hello, hb, register, report, ready, recover, deactivate, ping.
Coordinator -> rank: reply, hb_ack, announce, commit, peer, evicted, pong.
Supervisor -> coordinator: hello(role=supervisor), status, report_death,
request_admission, request_deactivation.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any


def encode(msg: dict[str, Any]) -> bytes:
    """Serialise one message to a single newline-terminated line of UTF-8 JSON."""
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


class Connection:
    """A socket carrying JSON lines; `send` is thread-safe, `recv` is for one reader thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rfile = sock.makefile("rb")
        self._send_lock = threading.Lock()

    def send(self, msg: dict[str, Any]) -> bool:
        """Send one message. Returns False (instead of raising) if the peer is gone."""
        data = encode(msg)
        try:
            with self._send_lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def recv(self) -> dict[str, Any] | None:
        """Block for the next message; None on EOF or a broken connection."""
        try:
            line = self._rfile.readline()
        except (OSError, ValueError):
            return None
        if not line:
            return None
        return json.loads(line)

    def close(self) -> None:
        """Shut the socket down both ways so the peer's reader sees EOF at once."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


def connect(address: str, timeout_s: float) -> Connection:
    """Open a control connection to ``"host:port"``.

    Raises:
        TimeoutError / ConnectionError: the coordinator is unreachable within timeout_s.
    """
    host, port = parse_address(address)
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.settimeout(None)
    return Connection(sock)


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"``. Raises ValueError on a malformed address."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"coordinator address must be 'host:port', got {address!r}")
    return host, int(port)
