"""The pyzmq transport and the ep_size=1 worker loop, with a fake engine (no model)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from elasticep import wire
from elasticep.elastic.serve_loop import run_engine_worker
from elasticep.engine.request import (
    AbortRequest,
    GenerateRequest,
    SamplingParams,
    TokenLogprobs,
    TokenOutput,
)
from elasticep.frontend_link import (
    FrontendChannel,
    OutputBatch,
    RankStats,
    RankUnreachableError,
    RequestError,
    StepFailed,
    WorkerChannel,
    WorkerHello,
)
from elasticep.frontend_link.channels import _HELLO, _OUTPUTS, _TO_RANK
from elasticep_testkit.serving.running_table import RunningTable

pytestmark = pytest.mark.timeout(30)


async def collect(channel: FrontendChannel, n: int, timeout_s: float = 5.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"got only {got}"
        got += await channel.poll(0.1)
    return got


def wait_poll(worker: WorkerChannel, n: int, timeout_s: float = 5.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"got only {got}"
        got += worker.poll(0.1)
    return got


def test_round_trip_unreachable_and_relaunch():
    async def main() -> None:
        fe = FrontendChannel()
        try:
            with pytest.raises(RankUnreachableError):
                fe.send(3, AbortRequest("x"))
            w = WorkerChannel(fe.endpoints, rank=3, epoch=7)
            w.hello()
            [hello] = await collect(fe, 1)
            assert isinstance(hello, WorkerHello) and hello.epoch == 7 and 3 in fe.connected
            req = GenerateRequest("r", (1, 2), output_token_ids=(5,))
            fe.send(3, req)
            fe.send(3, AbortRequest("r"))
            assert wait_poll(w, 2) == [req, AbortRequest("r")]
            w.send_outputs([TokenOutput("r", 1, 9)])
            w.send_outputs([])  # nothing to send: no message
            w.send_error("q", "too long")
            w.send_stats(steps=40, graph_captures=1, graph_replays=38)
            got = await collect(fe, 3)
            assert got[0].sent_us > 0  # stamped at the send, for the first-token trace
            assert got == [OutputBatch(3, 7, (TokenOutput("r", 1, 9),), sent_us=got[0].sent_us),
                           RequestError(3, "q", "too long"), RankStats(3, 7, 40, 1, 38)]
            w.close()
            # a relaunched rank reuses its identity and gets the next messages
            w2 = WorkerChannel(fe.endpoints, rank=3, epoch=8)
            w2.hello()
            await collect(fe, 1)
            assert fe.connected[3].epoch == 8
            fe.send(3, AbortRequest("again"))
            assert wait_poll(w2, 1) == [AbortRequest("again")]
            w2.close()
        finally:
            fe.close()

    asyncio.run(main())


def test_garbage_frames_are_dropped_and_polls_time_out():
    async def main() -> None:
        fe = FrontendChannel()
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(fe.endpoints.output_addr)
        try:
            push.send(b"not json")
            push.send(b"\x80\x05K\x01.")  # a pickled int: not our wire form
            push.send(b"[1, 2]")  # JSON, not an object
            push.send(b'{"t": "hello", "rank": 1, "epoch": 0, "pid": 5}')  # not on this socket
            push.send(b'{"t": "outputs", "rank": 1, "epoch": 0, "outputs": [["r", "0", 5, null, null]]}')
            push.send(b'{"t": "rank_stats", "rank": 1, "epoch": 0, "steps": 1}')  # lacks fields
            push.send(b'{"t": "request_error", "rank": 1, "request_id": "r", "message": "m"}')
            t0 = time.monotonic()
            messages = await fe.poll(0.3)
            messages += await fe.poll(0.1)
            # the six bad frames are dropped, nothing raised; the good one after them arrives
            assert messages == [RequestError(1, "r", "m")]
            assert time.monotonic() - t0 < 2
        finally:
            push.close(linger=0)
            ctx.term()
            fe.close()

    asyncio.run(main())


class FakeEngine(RunningTable):
    """Emits token 7 per step per request; refuses prompts longer than 3 tokens."""

    def __init__(self) -> None:
        self.running: dict[str, int] = {}

    def add_request(self, req: GenerateRequest) -> None:
        if len(req.prompt_token_ids) > 3:
            raise ValueError("prompt too long")
        self.running[req.request_id] = len(req.output_token_ids)

    def step(self) -> list[TokenOutput]:
        if "poison" in self.running:
            raise RuntimeError("sampler blew up")
        outs = []
        for rid, i in list(self.running.items()):
            done = i + 1 >= 3
            outs.append(TokenOutput(rid, i, 7, "length" if done else None))
            self.running[rid] = i + 1
            if done:
                del self.running[rid]
        return outs


def _engine_worker_thread(fe: FrontendChannel, engine: FakeEngine, stop: threading.Event,
                          raised: list[BaseException]) -> threading.Thread:
    """``run_engine_worker`` of ``engine`` as rank 0 of ``fe``, started in a thread; what
    it raises goes to ``raised``."""
    def work() -> None:
        w = WorkerChannel(fe.endpoints, rank=0)
        try:
            run_engine_worker(engine, w, 0, stop, idle_poll_s=0.02)
        except Exception as exc:  # noqa: BLE001 - the test checks what it was
            raised.append(exc)
        finally:
            w.close()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_engine_worker_loop_reports_a_crashed_step_before_it_raises():
    """The ep_size=1 loop tells the front-end which requests a raising step held (as
    the multi-rank worker does), so a poison request is failed, not resubmitted
    blindly; before, it sent nothing and the front-end only saw the rank go."""
    async def main() -> None:
        fe = FrontendChannel()
        raised: list[BaseException] = []
        thread = _engine_worker_thread(fe, FakeEngine(), threading.Event(), raised)
        try:
            await collect(fe, 1)  # hello
            fe.send(0, GenerateRequest("poison", (1,)))
            got = await collect(fe, 1)
            assert got == [StepFailed(0, ("poison",), "RuntimeError: sampler blew up")]
            thread.join(5)
        finally:
            fe.close()
        assert not thread.is_alive() and [str(e) for e in raised] == ["sampler blew up"]

    asyncio.run(main())


def test_engine_worker_loop_serves_requests_errors_and_resumes():
    async def main() -> None:
        fe = FrontendChannel()
        stop = threading.Event()
        raised: list[BaseException] = []
        thread = _engine_worker_thread(fe, FakeEngine(), stop, raised)
        try:
            await collect(fe, 1)  # hello
            fe.send(0, GenerateRequest("ok", (1,), output_token_ids=(7,)))  # resumed at index 1
            fe.send(0, GenerateRequest("big", (1, 2, 3, 4)))
            got = await collect(fe, 3)
            tokens = [o for m in got if isinstance(m, OutputBatch) for o in m.outputs]
            errors = [m for m in got if isinstance(m, RequestError)]
            while len(tokens) < 2:
                tokens += [o for m in await collect(fe, 1) for o in m.outputs]
            assert [(o.index, o.finish_reason) for o in tokens] == [(1, None), (2, "length")]
            assert errors == [RequestError(0, "big", "prompt too long")]
        finally:
            stop.set()
            thread.join(5)
            fe.close()
        assert not thread.is_alive()
        assert raised == []

    asyncio.run(main())


def test_rank_stats_become_metrics_series():
    from elasticep.frontend.metrics import FrontendMetrics
    m = FrontendMetrics()
    m.rank_stats(2, steps=40, captures=1, replays=38)
    m.rank_stats(3, steps=12, captures=-1, replays=-1)  # a rank without graphs
    text = m.render()[0].decode()
    assert 'elasticep_cuda_graph_captures{rank="2"} 1.0' in text
    assert 'elasticep_cuda_graph_replays{rank="2"} 38.0' in text
    assert 'elasticep_rank_steps{rank="3"} 12.0' in text
    assert 'elasticep_cuda_graph_captures{rank="3"}' not in text


def test_parse_rank_metric_reads_per_rank_gauges():
    from elasticep.frontend.metrics import FrontendMetrics
    from elasticep_testkit.harness.serve_process import parse_rank_metric
    m = FrontendMetrics()
    m.rank_stats(0, steps=5, captures=2, replays=4)
    m.rank_stats(3, steps=5, captures=1, replays=4)
    text = m.render()[0].decode()
    assert parse_rank_metric(text, "elasticep_cuda_graph_captures") == {0: 2.0, 3: 1.0}
    assert parse_rank_metric(text, "elasticep_nothing") == {}


def test_link_messages_ride_the_checked_wire_form():
    """Every front-end/worker message is a wire.Message: it round-trips through JSON,
    a token batch travels as rows, and a mistyped field is one ProtocolError line."""
    samples = [
        (GenerateRequest("a", (1, 2), SamplingParams(8, 0.5, 0.9, 4, -3, ("\n",), True), (7,)),
         _TO_RANK),
        (GenerateRequest("b", (3,)), _TO_RANK), (AbortRequest("a"), _TO_RANK),
        (WorkerHello(2, 5, 99, 4096, 8, "all_to_all"), _HELLO), (WorkerHello(2, 5, 99), _HELLO),
        (OutputBatch(1, 3, (TokenOutput("a", 0, 5), TokenOutput("a", 1, None, "abort", "x"))),
         _OUTPUTS),
        (RequestError(1, "a", "too long"), _OUTPUTS), (StepFailed(1, ("a", "b"), "boom"), _OUTPUTS),
        (RankStats(1, 3, 10, 1, 9), _OUTPUTS),
        # logprobs ride as two more items of the token's row
        (OutputBatch(1, 3, (TokenOutput("a", 0, 5, logprobs=TokenLogprobs(5, -0.5, ((5, -0.5),)),
                                        prompt_logprobs=(TokenLogprobs(2, -3.0),)),)), _OUTPUTS),
    ]
    for msg, kinds in samples:
        back = wire.decode_json(wire.encode_json(msg), kinds)
        assert back == msg and type(back) is type(msg)
    batch = wire.encode_json(samples[5][0])
    assert b'"outputs":[["a",0,5,null,null],["a",1,null,"abort","x"]]' in batch
    with pytest.raises(wire.ProtocolError, match=r"generate\.params\.temperature: expected "
                                                 r'float, got "hot"'):
        wire.decode_json(b'{"t": "generate", "request_id": "a", "prompt_token_ids": [1], '
                         b'"params": {"temperature": "hot"}}', _TO_RANK)
    with pytest.raises(wire.ProtocolError, match=r'expected TokenOutput, got \["a", true'):
        wire.decode_json(b'{"t": "outputs", "rank": 1, "epoch": 0, "outputs": [["a", true, 1, '
                         b'null, null]]}', _OUTPUTS)
    with pytest.raises(wire.ProtocolError, match="unknown front-end link message type 'abort'"):
        wire.decode_json(wire.encode_json(AbortRequest("a")), _OUTPUTS, "front-end link message")
