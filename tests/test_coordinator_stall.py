"""How a rank tells a stalled coordinator from a cut (issue 30, item 2): the kernel at
the other end of its control connection still acknowledges what the rank sends.

The served case (SIGSTOP of serve for 5 s under load: no request lost, same rank
processes, same epoch) is in test_serve_containment.py.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from elasticep.distributed.control import acks_fresh, peer_host_acks

pytestmark = pytest.mark.timeout(60)


def test_a_paused_peer_process_still_acknowledges():
    """The peer is a child process connected over 127.0.0.1: paused (SIGSTOP), its
    kernel still ACKs what we send; with nothing sent for longer than the window, no ACK
    is fresh (a cut sends none at all: tests/test_partition.py runs that case)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-c", (
            "import socket, time\n"
            f"s = socket.create_connection(('127.0.0.1', {port}))\n"
            "time.sleep(60)\n")])
        try:
            conn, _ = srv.accept()
            with conn:
                os.kill(child.pid, signal.SIGSTOP)
                for _ in range(5):  # heartbeats into a paused process
                    conn.sendall(b'{"t": "hb"}\n')
                    time.sleep(0.1)
                assert peer_host_acks(conn, 1.0)
                time.sleep(1.2)
                assert not peer_host_acks(conn, 1.0)  # nothing sent: no ACK is fresh
                conn.sendall(b'{"t": "hb"}\n')
                time.sleep(0.1)
                assert peer_host_acks(conn, 1.0)
        finally:
            child.kill()
            child.wait(10)


def test_an_unconnected_socket_is_no_evidence():
    with socket.socket() as s:
        assert not peer_host_acks(s, 10.0)


def test_acks_from_a_peer_that_cannot_hear_us_are_no_evidence():
    """A one-way cut: the coordinator's host still retransmits to the rank (duplicate
    ACKs keep tcpi_last_ack_recv fresh) while the rank's own heartbeats time out
    unacknowledged (tcpi_retransmits > 0): not a stalled process, a cut."""
    info = bytearray(104)
    struct.pack_into("I", info, 56, 100)  # an ACK 100 ms ago
    assert acks_fresh(bytes(info), 1.0)
    info[2] = 1  # one retransmission timeout of ours not yet recovered
    assert not acks_fresh(bytes(info), 1.0)
    info[2] = 0
    struct.pack_into("I", info, 56, 1500)
    assert not acks_fresh(bytes(info), 1.0)
