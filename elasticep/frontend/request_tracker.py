"""Front-end bookkeeping of in-flight requests: routing, ordering, resubmission, stops.

Pure logic with no sockets and no clocks of its own, so every failure case is unit
tested. The caller (the front-end event loop) feeds it events and sends the
:class:`SendToRank` commands it returns, in order:

- :meth:`RequestTracker.add` routes a new request to the healthy rank with the fewest
  running requests, among those below their ``max_running_requests``
  (:meth:`RequestTracker.set_capacity`). When every healthy rank is full the request
  waits here, in arrival order, and goes out as soon as a rank has room: a rank is
  never sent more requests than it can run.
- :meth:`RequestTracker.on_outputs` takes a rank's committed tokens. Tokens are
  delivered to the request's sink exactly once and in index order: duplicates (a redone
  step) are dropped, early ones are buffered until the gap is filled, and tokens from a
  rank that no longer owns the request are ignored. The last rule keeps the stream
  consistent with the prefix that was resubmitted: a near-tie token computed by a dead
  rank must not be mixed with a survivor's continuation.
- :meth:`RequestTracker.update_ranks` takes the membership (rank -> state). Requests on
  a rank that is no longer ``healthy`` are resubmitted to survivors as
  ``GenerateRequest(prompt, params, output_token_ids=tokens delivered so far)``; with no
  survivor they are parked until a rank becomes healthy.
- :meth:`RequestTracker.abort` drops a request whose client went away.
- A stop string ends the request with finish_reason "stop" and aborts it on its rank.
- :meth:`RequestTracker.on_step_failed` counts a rank's crashed step against the
  requests in it. The first crash is retried (the membership change resubmits the
  request, as for a killed rank); a request whose step raised on ranks
  :data:`POISON_CRASHES` times is poison: it fails with an error and is never
  resubmitted again, so one request cannot take down rank after rank (or use up
  every relaunch).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from elasticep.engine.request import (
    AbortRequest,
    GenerateRequest,
    SamplingParams,
    TokenLogprobs,
    TokenOutput,
)
from elasticep.frontend.incremental_text import Decode, IncrementalText
from elasticep.membership.transitions import SlotState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendToRank:
    """A command for the caller: send ``message`` to ``rank`` (best effort)."""

    rank: int
    message: GenerateRequest | AbortRequest


@dataclass(frozen=True)
class RequestEvent:
    """What a request's sink receives: one event per delivered token, or a final error.

    Attributes:
        token_ids: tokens delivered by this event (one, or none for an error).
        text: text newly released to the client (may be "" while a character or a
            possible stop string is incomplete).
        finish_reason: None while running, else "stop", "length" or "abort".
        error: set (with finish_reason "abort") when the request failed.
        num_generated: tokens delivered so far, this event included.
        refused: with ``error``: the engine refused the request itself (a client error,
            HTTP 400), not a failure of the deployment.
        logprobs: the logprobs of ``token_ids`` (when the request asked for them).
        prompt_logprobs: with the first token, when the request asked for them: the
            prompt tokens' logprobs (positions 1..P-1).
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    num_generated: int
    error: str | None = None
    refused: bool = False
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


# token ids -> text with the tokenizer's options (``skip_special_tokens``,
# ``spaces_between_special_tokens``) as keyword arguments
DecodeWith = Callable[..., str]

Sink = Callable[[RequestEvent], None]

POISON_CRASHES = 2  # crashed steps after which a request is failed, not retried


class NoRankAvailableError(RuntimeError):
    """No rank is healthy, so a new request cannot be routed."""


class DuplicateRequestError(ValueError):
    """A request with this id is already in flight."""


@dataclass
class _Tracked:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    sink: Sink
    text: IncrementalText
    rank: int | None = None
    generated: list[int] = field(default_factory=list)
    pending: dict[int, TokenOutput] = field(default_factory=dict)
    last_token_at: float = 0.0
    moved: bool = False  # resubmitted and waiting for its first token on the new rank
    resubmissions: int = 0
    crashed_ranks: list[int] = field(default_factory=list)  # ranks whose step raised on it


class RequestTracker:
    """Per-request state of the front-end, driven by the caller's event loop.

    Args:
        decode: token ids -> text, used for streaming deltas and stop strings.
        clock: monotonic seconds; injectable for tests.
        on_interruption: called with the stream gap (seconds) a resubmitted request
            saw, when its first token after the move is delivered.
        decode_with: token ids -> text with the detokenizer options as keywords, for
            requests whose ``skip_special_tokens`` / ``spaces_between_special_tokens``
            differ from ``decode``'s (True and True); None: ``decode`` for every one.
    """

    def __init__(self, decode: Decode, clock: Callable[[], float] = time.monotonic,
                 on_interruption: Callable[[float], None] | None = None,
                 decode_with: DecodeWith | None = None) -> None:
        self._decode = decode
        self._decode_with = decode_with
        self._clock = clock
        self._on_interruption = on_interruption
        self._requests: dict[str, _Tracked] = {}
        self._states: dict[int, str] = {}
        self._capacity: dict[int, int] = {}
        self.resubmitted_total = 0

    # ---- queries -------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Requests in flight, parked ones included."""
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        """Requests not on any rank: waiting for one with room (or moved, not placed)."""
        return sum(req.rank is None for req in self._requests.values())

    def healthy_ranks(self) -> list[int]:
        """Ranks new requests may be routed to, ascending."""
        return sorted(r for r, s in self._states.items() if s == SlotState.HEALTHY)

    def running_per_rank(self) -> dict[int, int]:
        """rank -> number of requests assigned to it (every known rank, zeros included)."""
        counts = {r: 0 for r in self._states}
        for req in self._requests.values():
            if req.rank is not None:
                counts[req.rank] = counts.get(req.rank, 0) + 1
        return counts

    def set_capacity(self, capacity: Mapping[int, int]) -> list[SendToRank]:
        """Set each rank's most running requests (a rank missing: no limit); returns the
        sends of waiting requests that now have room."""
        self._capacity = dict(capacity)
        return self._place_waiting()

    def rank_of(self, request_id: str) -> int | None:
        """The rank that owns the request, None if parked or unknown."""
        req = self._requests.get(request_id)
        return None if req is None else req.rank

    # ---- inputs --------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
            sink: Sink) -> list[SendToRank]:
        """Track a new request and route it (or keep it waiting, behind earlier ones,
        while every healthy rank is full).

        Raises:
            DuplicateRequestError: ``request_id`` is already in flight.
            NoRankAvailableError: no rank is healthy.
        """
        if request_id in self._requests:
            raise DuplicateRequestError(f"request {request_id!r} is already running")
        if not self.healthy_ranks():
            raise NoRankAvailableError("no healthy rank can take the request")
        req = _Tracked(request_id, tuple(prompt_token_ids), params, sink,
                       IncrementalText(self._decoder(params), params.stop),
                       last_token_at=self._clock())
        self._requests[request_id] = req
        return self._place_waiting()

    def on_outputs(self, rank: int, outputs: Sequence[TokenOutput]) -> list[SendToRank]:
        """Deliver a rank's committed tokens; return aborts for requests a stop string ended."""
        sends: list[SendToRank] = []
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None or req.rank != rank:
                continue  # finished, aborted, or a stale token from a previous owner
            if out.finish_reason == "abort":  # the rank failed this one request
                self._finish_error(req, out.error or f"request aborted by rank {rank}")
                continue
            if out.index < len(req.generated):
                continue  # duplicate from a redone step
            req.pending[out.index] = out
            while not self._is_done(req) and len(req.generated) in req.pending:
                sends.extend(self._deliver(req, req.pending.pop(len(req.generated))))
        return sends + self._place_waiting()

    def on_error(self, rank: int, request_id: str, message: str) -> list[SendToRank]:
        """A rank refused a request: fail it (a retry elsewhere would fail the same way);
        returns the sends of waiting requests that now have room."""
        req = self._requests.get(request_id)
        if req is not None and req.rank == rank:
            self._finish_error(req, message, refused=True)
        return self._place_waiting()

    def on_step_failed(self, rank: int, request_ids: Sequence[str], message: str,
                       ) -> list[SendToRank]:
        """A step holding ``request_ids`` raised on ``rank`` (the rank is exiting).

        Each request counts the crash; at :data:`POISON_CRASHES` it fails as a server
        error naming the ranks and the exception, and an abort goes to the rank it was
        resubmitted to meanwhile (if the report came after the membership change).
        Below that nothing happens here: the rank's failure resubmits the request.
        """
        sends: list[SendToRank] = []
        for request_id in request_ids:
            req = self._requests.get(request_id)
            if req is None:
                continue
            req.crashed_ranks.append(rank)
            if len(req.crashed_ranks) < POISON_CRASHES:
                continue
            if req.rank is not None and req.rank != rank:
                sends.append(SendToRank(req.rank, AbortRequest(request_id)))
            self._finish_error(req, f"the request's step raised on {len(req.crashed_ranks)} "
                               f"ranks {req.crashed_ranks}, so it is not retried again; "
                               f"last error: {message}")
        return sends

    def fail(self, request_id: str, message: str) -> None:
        """The deployment cannot finish a request (it is stopping): fail it as a server
        error, not as the client's (``refused`` stays False)."""
        req = self._requests.get(request_id)
        if req is not None:
            self._finish_error(req, message)

    def abort(self, request_id: str) -> list[SendToRank]:
        """Forget a request (client gone); returns the abort for its rank, if any."""
        req = self._requests.pop(request_id, None)
        if req is None or req.rank is None:
            return []
        return [SendToRank(req.rank, AbortRequest(request_id)), *self._place_waiting()]

    def update_ranks(self, states: Mapping[int, str]) -> list[SendToRank]:
        """Apply a membership snapshot (rank -> state); move requests off unhealthy ranks.

        Ranks missing from ``states`` count as free capacity. Returns aborts for the old ranks
        that may still be alive (anything but "failed") followed by the resubmissions.
        """
        self._states = dict(states)
        sends: list[SendToRank] = []
        for req in self._requests.values():
            if req.rank is not None and self._states.get(req.rank) == SlotState.HEALTHY:
                continue
            if req.rank is not None and self._states.get(req.rank) != SlotState.FAILED:
                sends.append(SendToRank(req.rank, AbortRequest(req.request_id)))
            sends.extend(self._resubmit(req))
        return sends

    # ---- internals -----------------------------------------------------------------
    def _decoder(self, params: SamplingParams) -> Decode:
        """The detokenizer of a request with ``params``' options."""
        if self._decode_with is None or (params.skip_special_tokens
                                         and params.spaces_between_special_tokens):
            return self._decode
        return functools.partial(
            self._decode_with, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens)

    def _pick_rank(self) -> int | None:
        """The healthy rank with the fewest requests among those with room, or None."""
        load = self.running_per_rank()
        room = [r for r in self.healthy_ranks()
                if r not in self._capacity or load.get(r, 0) < self._capacity[r]]
        return min(room, key=lambda r: (load.get(r, 0), r)) if room else None

    def _place_waiting(self) -> list[SendToRank]:
        """Send waiting requests (none sent yet, or moved off a rank) to ranks with room,
        oldest first, until none has room."""
        sends: list[SendToRank] = []
        for req in [r for r in self._requests.values() if r.rank is None]:
            rank = self._pick_rank()
            if rank is None:
                break
            sends.extend(self._send_to(req, rank))
        return sends

    def _send_to(self, req: _Tracked, rank: int) -> list[SendToRank]:
        req.rank = rank
        if not req.moved:  # its first send
            return [SendToRank(rank, GenerateRequest(req.request_id, req.prompt_token_ids,
                                               req.params))]
        req.resubmissions += 1
        self.resubmitted_total += 1
        logger.info("request %s moved to rank %d with %d generated tokens",
                    req.request_id, rank, len(req.generated))
        return [SendToRank(rank, GenerateRequest(req.request_id, req.prompt_token_ids, req.params,
                                           output_token_ids=tuple(req.generated)))]

    def _resubmit(self, req: _Tracked) -> list[SendToRank]:
        old = req.rank
        req.rank = None  # so it does not count towards the old rank's load
        req.pending.clear()  # buffered tokens came from the old rank
        req.moved = req.moved or old is not None  # sent again, it resumes from its tokens
        rank = self._pick_rank()
        if rank is None:
            if old is not None:
                logger.warning("request %s waiting: no healthy rank with room (was on rank "
                               "%d)", req.request_id, old)
            return []
        return self._send_to(req, rank)

    def _is_done(self, req: _Tracked) -> bool:
        return req.request_id not in self._requests

    def _deliver(self, req: _Tracked, out: TokenOutput) -> list[SendToRank]:
        now = self._clock()
        if req.moved:
            req.moved = False
            if self._on_interruption is not None:
                self._on_interruption(now - req.last_token_at)
        req.last_token_at = now
        req.generated.append(out.token_id)
        # a stop token id ends the request without its text (vLLM's default), as EOS
        # does with skip_special_tokens
        stop_token = out.finish_reason == "stop" and out.token_id in req.params.stop_token_ids
        text = "" if stop_token else req.text.push(out.token_id)
        finish = out.finish_reason
        sends: list[SendToRank] = []
        if req.text.stopped:
            finish = "stop"
            if out.finish_reason is None:
                sends.append(SendToRank(req.rank, AbortRequest(req.request_id)))
        elif finish is None and len(req.generated) >= req.params.max_tokens:
            # Defensive: a rank that overshoots max_tokens must not overshoot the client.
            finish = "length"
            sends.append(SendToRank(req.rank, AbortRequest(req.request_id)))
        if finish is not None:
            text += req.text.finish()
            del self._requests[req.request_id]
        self._emit(req, RequestEvent(req.request_id, (out.token_id,), text, finish,
                                     len(req.generated),
                                     logprobs=() if out.logprobs is None else (out.logprobs,),
                                     prompt_logprobs=out.prompt_logprobs))
        return sends

    def _finish_error(self, req: _Tracked, message: str, refused: bool = False) -> None:
        del self._requests[req.request_id]
        logger.warning("request %s %s: %s", req.request_id,
                       "refused" if refused else "failed", message)
        self._emit(req, RequestEvent(req.request_id, (), "", "abort", len(req.generated),
                                     error=message, refused=refused))

    @staticmethod
    def _emit(req: _Tracked, event: RequestEvent) -> None:
        try:
            req.sink(event)
        except Exception:  # noqa: BLE001 - one broken consumer must not stop the others
            logger.exception("sink of request %s raised", req.request_id)
