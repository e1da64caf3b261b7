"""The messages between the HTTP front-end and the worker ranks (besides the request
messages of `elasticep.engine.request`), the worker's addresses, and who may be routed to.

Every message is an :class:`elasticep.wire.Message`: one JSON object, whose fields are
checked against their annotations when it is read (the control messages' convention).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from elasticep.engine.request import AbortRequest, GenerateRequest, TokenOutput
from elasticep.membership.transitions import SlotState
from elasticep.wire import Message

# Messages the front-end sends to one rank.
RankMessage = GenerateRequest | AbortRequest


@dataclass(frozen=True)
class AbortOrigin(Message, tag="abort_origin"):
    """The front-end process whose link carried ``origin_id`` is gone (it died, or its
    supervisor gave it up): abort every request it sent to this rank, and any of its
    requests that arrive later. Sent by the node's own front-end for the supervisor of
    its extra processes (``serve --api-server-count``); never names a live process.

    Attributes:
        origin_id: the dead process's link id (:attr:`FrontendChannel.origin_id`).
    """

    origin_id: str


# What a front-end may send a rank: requests, and the link's own control.
ToRank = RankMessage | AbortOrigin


@dataclass(frozen=True)
class WorkerHello(Message, tag="hello"):
    """A worker rank announces itself (at start, after a relaunch, or a new epoch).

    Attributes:
        max_total_tokens: its KV-cache capacity in tokens (None: not reported).
        max_running_requests: the most requests it runs at once; the front-end routes
            no more to it (None: no limit reported).
        moe_a2a_backend: the MoE transport it runs (``cuda_ipc`` / ``all_to_all``;
            None: not reported).
    """

    rank: int
    epoch: int
    pid: int
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    moe_a2a_backend: str | None = None


def is_routable(state: SlotState, pid: int | None, hello: WorkerHello | None) -> bool:
    """Whether requests may be sent to a rank (pure): membership says ``healthy`` and its
    worker said hello with the pid membership reports (``pid`` None: membership knows
    no pid), so a request never goes to a dead predecessor of the slot."""
    return (state == SlotState.HEALTHY and hello is not None
            and (pid is None or hello.pid == pid))


def monotonic_us() -> int:
    """The host's ``CLOCK_MONOTONIC`` in microseconds: the clock of
    :class:`FirstTokenTimes` and of the front-end's first-token stamps."""
    return time.monotonic_ns() // 1000


@dataclass(frozen=True)
class FirstTokenTimes:
    """A rank's side of one request's first token (:mod:`elasticep.elastic.first_token_clock`).

    Times are microseconds of the host's ``CLOCK_MONOTONIC`` (:func:`monotonic_us`), which every process of one host shares, so the front-end can subtract its
    own stamps from them; across hosts only the differences within one side mean
    anything. Integers, so a list of these travels as rows.

    Attributes:
        request_id: the request.
        received_us: the rank took the request off the link.
        scheduled_us: the step that computed its first prompt chunk began.
        committed_us: the step that drew its first token committed.
        steps: steps the rank committed from receipt to that token, that one included
            (1: admitted into the rank's next step).
    """

    request_id: str
    received_us: int
    scheduled_us: int
    committed_us: int
    steps: int


@dataclass(frozen=True)
class OutputBatch(Message, tag="outputs"):
    """Tokens of one committed step of one rank, published in index order per request.

    Attributes:
        first_tokens: the rank's times of the requests whose first token on this rank
            is in ``outputs``.
        sent_us: when the rank handed the batch to the link (``CLOCK_MONOTONIC``
            microseconds; 0: not stamped).
    """

    rank: int
    epoch: int
    outputs: tuple[TokenOutput, ...]
    first_tokens: tuple[FirstTokenTimes, ...] = ()
    sent_us: int = 0


@dataclass(frozen=True)
class RequestError(Message, tag="request_error"):
    """A rank refused or failed one request (for example: it does not fit the KV cache)."""

    rank: int
    request_id: str
    message: str


@dataclass(frozen=True)
class StepFailed(Message, tag="step_failed"):
    """A rank's step raised (not a membership change) and the rank is exiting.

    ``request_ids`` were in that step; the front-end counts it against each of them,
    so a request that crashed ranks twice is failed instead of resubmitted again.
    """

    rank: int
    request_ids: tuple[str, ...]
    message: str


@dataclass(frozen=True)
class RankStats(Message, tag="rank_stats"):
    """A rank's running counters, sent with each of its throughput lines (every
    ``--log-stats-interval`` seconds) for ``/metrics``.

    Attributes:
        rank, epoch: the sender and its epoch.
        steps: committed steps since the rank started.
        graph_captures: complete decode CUDA graph captures since start (start-up
            included; a re-capture after a membership change adds one), or -1 where
            the rank runs no graphs.
        graph_replays: forwards replayed from a graph since start, an idle EP rank's
            included (-1: no graphs).
        decode_replays, decode_eager: decode steps (every sequence of the rank's batch
            decodes one token) since start that replayed a graph / ran eagerly
            (:class:`~elasticep.engine.model_runner.ModelRunner`).
        prefill_replays: steps with prefill tokens since start that replayed a decode
            graph as one row a token.
        experts_held: its expert slots that hold an expert (the most over MoE layers),
            or -1 where not known.
    """

    rank: int
    epoch: int
    steps: int
    graph_captures: int
    graph_replays: int
    decode_replays: int = 0
    decode_eager: int = 0
    experts_held: int = -1
    prefill_replays: int = 0


# Messages a worker sends to the front-end.
WorkerMessage = WorkerHello | OutputBatch | RequestError | StepFailed | RankStats


@dataclass(frozen=True)
class LinkEndpoints:
    """The two addresses a worker connects to, e.g. ``tcp://127.0.0.1:5555``."""

    request_addr: str
    output_addr: str
