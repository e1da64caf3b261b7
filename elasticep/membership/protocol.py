"""Control-plane transport: newline-delimited JSON objects over TCP.

One message per line; what a line holds is the typed message of ``messages.py``
(``"t"`` names its type).
"""

from __future__ import annotations

import json
import socket
import threading

from .messages import ControlMessage, decode_line


def encode(msg: ControlMessage) -> bytes:
    """Serialise one message to a single newline-terminated line of UTF-8 JSON."""
    return (json.dumps(msg.to_wire(), separators=(",", ":")) + "\n").encode()


class Connection:
    """A socket carrying JSON lines; `send` is thread-safe, `recv` is for one reader thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rfile = sock.makefile("rb")
        self._send_lock = threading.Lock()

    def send(self, msg: ControlMessage) -> bool:
        """Send one message. Returns False (instead of raising) if the peer is gone."""
        data = encode(msg)
        try:
            with self._send_lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def recv(self) -> ControlMessage | None:
        """Block for the next message; None on EOF or a broken connection.

        Raises:
            ProtocolError: the line is not a valid message (the connection stays usable).
        """
        try:
            line = self._rfile.readline()
        except (OSError, ValueError):
            return None
        if not line:
            return None
        return decode_line(line)

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
