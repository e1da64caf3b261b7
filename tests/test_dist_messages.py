"""Control messages: the JSON-lines wire form of every type, and one-line refusals of
malformed ones (by the codec and by a live coordinator)."""

import dataclasses
import json
import socket
import typing

import pytest

from elasticep.membership import CoordinatorClient, start_coordinator
from elasticep.membership import messages as m
from elasticep.membership.protocol import Connection, encode
from elasticep.membership.transitions import Decision, OnFailure, SlotState

_DECISION = Decision("failure", 3, (0, 1), (2,), 7, 8, {8: 0}, True, 9)
_SAMPLES = {int: 5, str: "w", bool: True, float: 0.5, Decision: _DECISION,
            list[int]: [1, 2], list[SlotState]: [SlotState.HEALTHY, SlotState.FREE],
            dict[str, list[int]]: {"admit": [4], "remove": []}, dict[str, typing.Any]: {"x": 1},
            int | None: None, list[int] | None: [3], str | None: "why",
            OnFailure: OnFailure.RAISE, dict[str, list[int]] | None: {"world": [3, 0]}}


def _all_types() -> list[type[m.ControlMessage]]:
    return m.message_types()


def _sample(cls: type[m.ControlMessage]) -> m.ControlMessage:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in ("id", "role")]
    return cls(**{f: _SAMPLES[hints[f]] for f in names}, id=11)


def test_every_type_round_trips_through_one_json_line():
    assert len(_all_types()) == 29
    for cls in _all_types():
        msg = _sample(cls)
        line = encode(msg)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert m.decode_line(line) == msg, cls.__name__


def test_wire_form_is_unchanged():
    """The JSON objects are the ones the dict-based protocol sent."""
    assert m.RankHello(2, 99, 4, 6, True, id=1).to_wire() == {
        "t": "hello", "id": 1, "rank": 2, "pid": 99, "world_size": 4, "max_world_size": 6,
        "is_extension": True}
    assert m.SupervisorHello(id=1).to_wire() == {"t": "hello", "id": 1, "role": "supervisor"}
    assert m.Heartbeat().to_wire() == {"t": "hb"}
    assert m.Commit("world", [SlotState.HEALTHY], {"admit": [], "remove": [1]}, _DECISION
                    ).to_wire() == {"t": "commit", "group": "world",
                                    "decision": _DECISION.to_dict(), "states": ["healthy"],
                                    "requests": {"admit": [], "remove": [1]}}
    assert m.Release(id=4).to_wire() == {"t": "release", "id": 4, "ranks": None}
    assert m.Reply(id=3, ok=True, body={"epoch": 2}).to_wire() == {
        "t": "reply", "id": 3, "ok": True, "epoch": 2}
    assert m.Reply(id=3, ok=False, error="no", code="refused").to_wire() == {
        "t": "reply", "id": 3, "ok": False, "error": "no", "code": "refused"}
    # hello without a supervisor role is a rank's
    assert isinstance(m.from_wire({"t": "hello", "rank": 0, "pid": 1, "world_size": 1,
                                   "max_world_size": 1, "is_extension": False}), m.RankHello)


@pytest.mark.parametrize("wire, error", [
    (b"GET / HTTP/1.1\r\n", "control message is not JSON"),
    (b"[1, 2]\n", "must be a JSON object, got list"),
    (b'{"id": 3}\n', "unknown control message type None"),
    (b'{"t": "nonsense", "id": 3}\n', "unknown control message type 'nonsense'"),
    (b'{"t": "scale", "id": 3}\n', "'scale' message lacks field 'new_ep_size'"),
    (b'{"t": "scale", "id": 3, "new_ep_size": "4"}\n', 'scale.new_ep_size: expected int, got "4"'),
    (b'{"t": "scale", "id": 3, "new_ep_size": true}\n', "scale.new_ep_size: expected int"),
    (b'{"t": "ready", "id": 3, "group": "w", "x": 1}\n', "'ready' message has unknown field"),
    (b'{"t": "peer", "group": "w", "states": ["dead"], "requests": {}}\n',
     "peer.states: expected SlotState"),
    (b'{"t": "commit", "group": "w", "decision": {"epoch": 1}, "states": [], "requests": {}}\n',
     "commit.decision: expected Decision"),
    (b'{"t": "register", "id": 3, "group": "w", "global_ranks": [0], "active": [0], '
     b'"on_failure": "sometimes", "is_extension": false}\n',
     'register.on_failure: expected OnFailure, got "sometimes"'),
])
def test_malformed_messages_are_one_line_protocol_errors(wire, error):
    with pytest.raises(m.ProtocolError) as info:
        m.decode_line(wire)
    assert error in str(info.value) and "\n" not in str(info.value)
    assert info.value.rid == (3 if b'"id": 3' in wire else None)
    with pytest.raises(m.ProtocolError, match="has no field 'slot'"):
        m.Reply(id=1, ok=True)["slot"]


def test_on_failure_is_its_enum_end_to_end():
    """Register carries OnFailure: encoded as its value, decoded back to the enum; a
    reply's field is read back typed (a bad value is a ProtocolError, not a ValueError
    deep in the rank)."""
    msg = m.Register("w", [0, 1], [0, 1], OnFailure.RAISE, False, id=4)
    wire = msg.to_wire()
    assert wire["on_failure"] == "raise"
    back = m.from_wire(json.loads(json.dumps(wire)))
    assert back == msg and type(back.on_failure) is OnFailure
    reply = m.from_wire({"t": "reply", "id": 4, "ok": True, "on_failure": "raise",
                         "states": ["healthy", "failed"]})
    assert reply.typed("on_failure", OnFailure) is OnFailure.RAISE
    assert reply.typed("states", list[SlotState]) == [SlotState.HEALTHY, SlotState.FAILED]
    bad = m.Reply(id=5, ok=True, body={"on_failure": "sometimes"})
    with pytest.raises(m.ProtocolError, match="reply.on_failure: expected OnFailure") as info:
        bad.typed("on_failure", OnFailure)
    assert info.value.rid == 5


def test_coordinator_answers_malformed_requests_and_keeps_serving():
    """A bad line, an unknown type, a rank message on a supervisor connection: each gets
    a one-line refusal with its id; the connection and the coordinator stay usable."""
    coord = start_coordinator()
    try:
        host, port = coord.address.rsplit(":", 1)
        conn = Connection(socket.create_connection((host, int(port)), timeout=10))
        conn.sock.settimeout(10)
        conn.sock.sendall(b"not json\n")  # no id to answer: only logged
        conn.sock.sendall(json.dumps({"t": "frobnicate", "id": 7}).encode() + b"\n")
        reply = conn.recv()
        assert (reply.id, reply.ok, reply.code) == (7, False, "malformed")
        assert reply.error == "unknown control message type 'frobnicate'"
        conn.send(m.Ready("world", id=8))
        reply = conn.recv()
        assert (reply.id, reply.ok) == (8, False)
        assert reply.error == "a 'ready' message must come from a rank connection (after its hello)"
        conn.send(m.SupervisorHello(id=9))
        assert conn.recv() == m.Reply(id=9, ok=True, body={"store_port": coord.store.port})
        conn.send(m.Recover("nope", [1], id=10))
        assert conn.recv().error == "a 'recover' message must come from a rank connection " \
                                    "(after its hello)"
        conn.close()
        client = CoordinatorClient(coord.address)
        with pytest.raises(m.ProtocolError, match="takes no 'announce' messages"):
            client._call(m.Announce("world", 1))
        assert client.deployment_config() is None  # still serving this connection
        client.close()
    finally:
        coord.close()


def test_rank_gets_a_broken_reply_as_an_error_at_once():
    """A reply the rank cannot read fails its request with one line, not a timeout."""
    import threading
    import time

    from elasticep.distributed.control import RankControl

    server = socket.create_server(("127.0.0.1", 0))

    def answer_badly() -> None:
        conn, _ = server.accept()
        with conn:
            hello = json.loads(conn.makefile("rb").readline())
            conn.sendall(json.dumps({"t": "reply", "id": hello["id"], "ok": "yes"}).encode()
                         + b"\n")
            closed.append(conn.recv(1) == b"")  # the refused rank closes its end

    closed: list[bool] = []
    t = threading.Thread(target=answer_badly, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"^bad reply: reply.ok: expected bool, got \"yes\"$"):
        RankControl(f"127.0.0.1:{server.getsockname()[1]}", 0, 1, 1, False, timeout_s=20)
    assert time.monotonic() - t0 < 5
    t.join(5)
    assert closed == [True]
    server.close()
