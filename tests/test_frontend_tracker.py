"""Unit tests of the front-end request tracker and incremental detokenizer (no sockets)."""

from __future__ import annotations

import random

import pytest

from elasticep.engine.request import AbortRequest, GenerateRequest, SamplingParams, TokenOutput
from elasticep.frontend.incremental_text import IncrementalText
from elasticep.frontend.request_tracker import (
    DuplicateRequestError,
    NoRankAvailableError,
    RequestEvent,
    RequestTracker,
    SendToRank,
)


def byte_decode(ids):
    """Token id = one byte, so multi-byte characters span tokens."""
    return bytes(ids).decode("utf-8", errors="replace")


def toks(text: str) -> list[int]:
    return list(text.encode())


class Client:
    """Collects a request's events, as the HTTP layer would."""

    def __init__(self) -> None:
        self.events: list[RequestEvent] = []

    def __call__(self, event: RequestEvent) -> None:
        self.events.append(event)

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def finish(self) -> str | None:
        return self.events[-1].finish_reason if self.events else None


def out(rid, i, tok, finish=None):
    return TokenOutput(rid, i, tok, finish)


def params(**kw):
    kw.setdefault("max_tokens", 100)
    return SamplingParams(**kw)


# ---- incremental text -----------------------------------------------------------------
def test_incremental_text_holds_incomplete_utf8():
    inc = IncrementalText(byte_decode)
    deltas = [inc.push(t) for t in toks("aé€b")]
    assert deltas == ["a", "", "é", "", "", "€", "b"]
    assert inc.finish() == ""


def test_incremental_text_stop_string_across_tokens_is_never_streamed():
    inc = IncrementalText(byte_decode, stop=("STOP",))
    streamed = ""
    for t in toks("hello STOP world"):
        streamed += inc.push(t)
        if inc.stopped:
            break
    streamed += inc.finish()
    assert inc.stopped and streamed == "hello " and inc.text == "hello "


def test_incremental_text_flushes_holdback_at_finish():
    inc = IncrementalText(byte_decode, stop=("xyz",))
    streamed = "".join(inc.push(t) for t in toks("abcxy"))
    assert streamed == "abc"
    assert inc.finish() == "xy" and not inc.stopped


# ---- routing --------------------------------------------------------------------------
def test_routes_to_least_loaded_healthy_rank():
    tr = RequestTracker(byte_decode)
    tr.update_ranks({0: "healthy", 1: "healthy", 2: "joining", 3: "failed"})
    ranks = [tr.add(f"r{i}", [1], params(), Client())[0].rank for i in range(5)]
    assert ranks == [0, 1, 0, 1, 0]
    assert tr.running_per_rank() == {0: 3, 1: 2, 2: 0, 3: 0}
    tr.abort("r0")
    tr.abort("r2")
    assert tr.add("r9", [1], params(), Client())[0].rank == 0


def test_add_errors():
    tr = RequestTracker(byte_decode)
    with pytest.raises(NoRankAvailableError):
        tr.add("a", [1], params(), Client())
    tr.update_ranks({0: "healthy"})
    tr.add("a", [1], params(), Client())
    with pytest.raises(DuplicateRequestError):
        tr.add("a", [1], params(), Client())


# ---- ordering and dedup ---------------------------------------------------------------
def test_dedup_and_reorder_deliver_each_token_once_in_order():
    tr = RequestTracker(byte_decode)
    tr.update_ranks({0: "healthy"})
    c = Client()
    tr.add("a", [1], params(max_tokens=5), c)
    word = toks("hello")
    tr.on_outputs(0, [out("a", 1, word[1]), out("a", 0, word[0])])
    tr.on_outputs(0, [out("a", 0, word[0]), out("a", 1, word[1])])  # redone step
    tr.on_outputs(0, [out("a", 3, word[3])])
    assert c.tokens == word[:2]
    tr.on_outputs(0, [out("a", 4, word[4], "length"), out("a", 2, word[2])])
    assert c.tokens == word and c.text == "hello" and c.finish == "length"
    assert [e.num_generated for e in c.events] == [1, 2, 3, 4, 5]  # one event per token
    assert tr.num_running == 0
    tr.on_outputs(0, [out("a", 5, 1)])  # late token of a finished request: ignored
    assert len(c.events) == 5


def test_tokens_from_a_rank_that_does_not_own_the_request_are_ignored():
    tr = RequestTracker(byte_decode)
    tr.update_ranks({0: "healthy", 1: "healthy"})
    c = Client()
    tr.add("a", [1], params(), c)
    tr.on_outputs(1, [out("a", 0, 65)])
    assert c.events == []


# ---- resubmission ---------------------------------------------------------------------
def test_failed_rank_requests_resume_on_survivor_without_gaps_or_duplicates():
    """Randomised: outputs arrive reordered and duplicated, a rank dies at a random point,
    and its late tokens still trickle in. Every stream must equal the reference exactly."""
    rng = random.Random(0)
    refs = {f"r{i}": [rng.randrange(97, 123) for _ in range(12)] for i in range(6)}
    clock = [0.0]
    gaps: list[float] = []
    tr = RequestTracker(byte_decode, clock=lambda: clock[0], on_interruption=gaps.append)
    tr.update_ranks({0: "healthy", 1: "healthy", 2: "healthy"})
    clients = {rid: Client() for rid in refs}
    # what each rank has been asked to generate: rid -> next index it will produce
    progress: dict[int, dict[str, int]] = {0: {}, 1: {}, 2: {}}

    def apply(sends: list[SendToRank]) -> None:
        for s in sends:
            if isinstance(s.message, GenerateRequest):
                progress[s.rank][s.message.request_id] = len(s.message.output_token_ids)
                assert list(s.message.output_token_ids) == refs[s.message.request_id][
                    :len(s.message.output_token_ids)]
            else:
                progress[s.rank].pop(s.message.request_id, None)

    for rid in refs:
        apply(tr.add(rid, [1, 2], params(max_tokens=12), clients[rid]))
    dead_late: list[TokenOutput] = []
    for step in range(40):
        clock[0] += 1.0
        if step == 4:
            victim = max(progress, key=lambda r: len(progress[r]))
            # the victim committed one more step that the front-end never saw in time
            # ... and a near tie made it pick a different token than a survivor will
            dead_late = [out(rid, i, ord("!")) for rid, i in progress[victim].items()]
            progress.pop(victim)
            apply(tr.update_ranks({r: "healthy" for r in progress} | {victim: "failed"}))
        for rank, reqs in progress.items():
            batch = []
            for rid, i in list(reqs.items()):
                if i < 12:
                    batch.append(out(rid, i, refs[rid][i], "length" if i == 11 else None))
                    reqs[rid] = i + 1
            if rng.random() < 0.3:  # a redone step re-publishes
                batch += batch[: len(batch) // 2]
            rng.shuffle(batch)
            tr.on_outputs(rank, batch)
        if step == 6:
            tr.on_outputs(victim, dead_late)
    for rid, c in clients.items():
        assert c.tokens == refs[rid], rid
        assert c.finish == "length"
    assert tr.num_running == 0
    assert tr.resubmitted_total >= 1 and gaps and all(g > 0 for g in gaps)


def test_draining_rank_gets_abort_and_parked_requests_resume():
    tr = RequestTracker(byte_decode)
    tr.update_ranks({0: "healthy", 1: "healthy"})
    c = Client()
    assert tr.add("a", [7], params(), c) == [SendToRank(0, GenerateRequest("a", (7,), params()))]
    tr.on_outputs(0, [out("a", 0, 65)])
    sends = tr.update_ranks({0: "draining", 1: "healthy"})
    assert sends == [SendToRank(0, AbortRequest("a")),
                     SendToRank(1, GenerateRequest("a", (7,), params(), output_token_ids=(65,)))]
    # the only survivor fails: the request is parked, not failed
    assert tr.update_ranks({0: "free", 1: "failed"}) == []
    assert tr.rank_of("a") is None and tr.num_running == 1
    sends = tr.update_ranks({0: "free", 1: "failed", 2: "healthy"})
    assert sends == [SendToRank(2, GenerateRequest("a", (7,), params(), output_token_ids=(65,)))]
    tr.on_outputs(2, [out("a", 1, 66, "stop")])
    assert c.text == "AB" and c.finish == "stop"


def test_a_rank_is_never_sent_more_requests_than_its_max_running_requests():
    """Each rank reports its max_running_requests in its hello; beyond them requests wait
    in the front-end, oldest first, and go out as soon as a rank has room."""
    tr = RequestTracker(byte_decode)
    tr.update_ranks({0: "healthy", 1: "healthy"})
    assert tr.set_capacity({0: 2, 1: 1}) == []
    clients = {rid: Client() for rid in "abcde"}
    sent = [tr.add(rid, [7], params(), c) for rid, c in clients.items()]
    assert sent[:3] == [[SendToRank(0, GenerateRequest("a", (7,), params()))],
                        [SendToRank(1, GenerateRequest("b", (7,), params()))],
                        [SendToRank(0, GenerateRequest("c", (7,), params()))]]
    assert sent[3:] == [[], []]  # d and e wait: both ranks are full
    assert tr.running_per_rank() == {0: 2, 1: 1} and tr.num_running == 5
    assert tr.rank_of("d") is None and tr.rank_of("e") is None
    # b finishes on rank 1: d, the oldest waiting, takes its place; e still waits
    sends = tr.on_outputs(1, [out("b", 0, 65, "stop")])
    assert sends == [SendToRank(1, GenerateRequest("d", (7,), params()))]
    assert clients["b"].finish == "stop" and tr.rank_of("e") is None
    # a client leaves rank 0: e goes there
    assert tr.abort("a") == [SendToRank(0, AbortRequest("a")),
                             SendToRank(0, GenerateRequest("e", (7,), params()))]
    assert tr.running_per_rank() == {0: 2, 1: 1}
    assert tr.resubmitted_total == 0  # waiting requests were sent once, not moved


def test_requests_of_a_failed_rank_wait_for_room_on_the_survivors():
    tr = RequestTracker(byte_decode)
    tr.update_ranks({0: "healthy", 1: "healthy"})
    tr.set_capacity({0: 1, 1: 1})
    a, b = Client(), Client()
    tr.add("a", [7], params(), a)
    tr.add("b", [8], params(), b)
    tr.on_outputs(1, [out("b", 0, 66)])
    # rank 1 dies: its request must not overflow rank 0, which runs "a"
    assert tr.update_ranks({0: "healthy", 1: "failed"}) == []
    assert tr.rank_of("b") is None and tr.running_per_rank() == {0: 1, 1: 0}
    # "a" finishes: "b" resumes on rank 0 from its delivered token
    sends = tr.on_outputs(0, [out("a", 0, 65, "stop")])
    assert sends == [SendToRank(0, GenerateRequest("b", (8,), params(), output_token_ids=(66,)))]
    assert tr.resubmitted_total == 1
    # a rank that reports a larger capacity takes more at once
    assert tr.set_capacity({0: 4}) == []
    c = Client()
    assert tr.add("c", [9], params(), c) == [SendToRank(0, GenerateRequest("c", (9,), params()))]


def test_a_refused_request_makes_room_for_a_waiting_one():
    tr = RequestTracker(byte_decode)
    tr.update_ranks({0: "healthy"})
    tr.set_capacity({0: 1})
    a, b = Client(), Client()
    tr.add("a", [7], params(), a)
    assert tr.add("b", [7], params(), b) == []
    assert tr.on_error(0, "a", "prompt too long") == [SendToRank(0, GenerateRequest("b", (7,),
                                                                              params()))]
    assert a.events[-1].refused and tr.rank_of("b") == 0


# ---- stop strings, aborts, errors -----------------------------------------------------
def test_stop_string_aborts_on_rank_and_trims_text():
    tr = RequestTracker(byte_decode)
    tr.update_ranks({0: "healthy"})
    c = Client()
    tr.add("a", [1], params(stop=("\n\n",)), c)
    word = toks("ab\n\ncd")
    sends = tr.on_outputs(0, [out("a", i, t) for i, t in enumerate(word)])
    assert sends == [SendToRank(0, AbortRequest("a"))]
    assert c.text == "ab" and c.finish == "stop" and len(c.events) == 4
    assert tr.num_running == 0


def test_client_abort_and_rank_errors():
    tr = RequestTracker(byte_decode)
    tr.update_ranks({0: "healthy"})
    c1, c2 = Client(), Client()
    tr.add("a", [1], params(), c1)
    tr.add("b", [1], params(), c2)
    assert tr.abort("a") == [SendToRank(0, AbortRequest("a"))]
    assert tr.abort("a") == []
    tr.on_outputs(0, [out("a", 0, 65)])
    assert c1.events == []
    tr.on_error(0, "b", "prompt does not fit the KV cache")
    assert c2.finish == "abort" and "KV cache" in c2.events[-1].error
    assert c2.events[-1].refused  # the engine's refusal: the client's error (400)
    assert tr.num_running == 0
    # a deployment that stops fails its requests as server errors, not refusals
    c3 = Client()
    tr.add("c", [1], params(), c3)
    tr.fail("c", "the deployment is stopping")
    assert c3.finish == "abort" and not c3.events[-1].refused
    assert c3.events[-1].error == "the deployment is stopping" and tr.num_running == 0


def test_overshooting_rank_is_cut_at_max_tokens():
    tr = RequestTracker(byte_decode)
    tr.update_ranks({0: "healthy"})
    c = Client()
    tr.add("a", [1], params(max_tokens=2), c)
    sends = tr.on_outputs(0, [out("a", i, 65) for i in range(4)])
    assert sends == [SendToRank(0, AbortRequest("a"))]
    assert c.tokens == [65, 65] and c.finish == "length"
