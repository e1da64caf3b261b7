"""TCP sockets bound the way our servers bind them."""

from __future__ import annotations

import socket


def bind_tcp(host: str, port: int, family: socket.AddressFamily | None = None
             ) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEADDR`` (as uvicorn and
    ``socket.create_server`` bind), not yet listening. Port 0 picks a free port.

    Args:
        host: a local address or name.
        port: TCP port, 0 for any free one.
        family: the address family; None: IPv6 when ``host`` has a colon, else IPv4.

    Raises:
        OSError: the address is in use or not local (the socket is closed).
    """
    if family is None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock
