"""The ep_size=1 worker loop: an :class:`LLMEngine` served over the front-end link's
worker channel (:class:`~elasticep.frontend_link.WorkerChannel`).

Each iteration takes every request and abort that arrived, runs one engine step if
anything is unfinished, and publishes that step's tokens (with the rank's times of the
first tokens among them: :mod:`.first_token_clock`). With nothing to do it blocks
in ``poll`` for at most ``idle_poll_s`` so a stop request is noticed quickly. The
multi-rank elastic worker makes the same link calls around its lockstep step.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from elasticep.elastic.first_token_clock import FirstTokenClock
from elasticep.engine.request import AbortRequest, GenerateRequest, TokenOutput
from elasticep.frontend_link import WorkerChannel

logger = logging.getLogger(__name__)


class StepEngine(Protocol):
    """What the loop needs from an engine (``LLMEngine`` satisfies it)."""

    def add_request(self, req: GenerateRequest) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[TokenOutput]: ...

    def request_ids(self) -> list[str]: ...


def apply_messages(engine: StepEngine, channel: WorkerChannel,
                   messages: list[GenerateRequest | AbortRequest]) -> None:
    """Hand received requests/aborts to the engine; refusals go back as RequestError."""
    for msg in messages:
        if isinstance(msg, AbortRequest):
            engine.abort(msg.request_id)
            continue
        # A resubmitted request may still be known here if the front-end moved it
        # between two ranks and back; the newest copy wins.
        engine.abort(msg.request_id)
        try:
            engine.add_request(msg)
        except ValueError as exc:
            logger.warning("rank %d epoch %d: refusing request %s: %s", channel.rank,
                           channel.epoch, msg.request_id, exc)
            channel.send_error(msg.request_id, str(exc))


def run_engine_worker(engine: StepEngine, channel: WorkerChannel, rank: int,
                      stop_event: threading.Event, idle_poll_s: float = 0.05) -> None:
    """Serve ``engine`` on ``channel`` until ``stop_event`` is set.

    Args:
        engine: a single-process engine.
        channel: the connected worker side of the front-end link (not closed here).
        rank: this worker's rank, for logs (the channel carries it on the wire).
        stop_event: set it to make the loop return after the current step.
        idle_poll_s: longest wait for a message while idle (seconds).

    Raises:
        FrontendUnreachableError: outputs could not be handed to the front-end.
        Exception: whatever a step raised, after it was reported to the front-end as a
            ``StepFailed`` for every request the engine held (as the multi-rank worker
            does: a request that crashed two ranks is then failed, not resubmitted).
    """
    channel.hello()
    logger.info("rank %d epoch %d: engine worker serving", rank, channel.epoch)
    steps = 0
    clock = FirstTokenClock()
    while not stop_event.is_set():
        busy = engine.has_unfinished()
        messages = channel.poll(0.0 if busy else idle_poll_s)
        if messages:
            clock.received(messages, steps)
            apply_messages(engine, channel, messages)
        if not engine.has_unfinished():
            continue
        clock.step_started()
        try:
            outputs = engine.step()
        except Exception as exc:
            logger.error("rank %d epoch %d: step %d failed: %r", rank, channel.epoch, steps,
                         exc)
            report_step_failure(channel, engine.request_ids(), exc)
            raise
        steps += 1
        channel.send_outputs(outputs, first_tokens=clock.committed(outputs, steps))
    logger.info("rank %d epoch %d: engine worker stopped after %d steps", rank,
                channel.epoch, steps)


def report_step_failure(channel: WorkerChannel, request_ids: list[str],
                        exc: BaseException) -> None:
    """Blame ``exc`` on ``request_ids`` (the step's requests) with a ``StepFailed`` to the
    front-end, best effort: the rank exits anyway, so a failed send is only logged."""
    if not request_ids:
        return
    try:
        channel.send_step_failed(request_ids, f"{type(exc).__name__}: {exc}")
    except Exception as err:  # noqa: BLE001 - the rank exits anyway
        logger.warning("rank %d: could not report the failed step of requests %s: %r",
                       channel.rank, request_ids, err)
