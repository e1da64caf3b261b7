"""The membership-change routes: ``POST /scale_elastic_ep`` and ``GET
/scale_elastic_ep/{operation_id}``.

A POST names one change: ``{"new_ep_size": K}`` (grow, or shrink from the top, as
SGLang's), ``{"retire_ranks": [r, ...]}`` or ``{"drain_node": n}`` (those slots drain:
their experts and requests move to the others, then they leave and their workers exit,
or stay up idle with ``"keep_processes": true``).
Its answer carries an ``operation_id`` (the caller's, or a new one); the GET reads the
operation's phase and each slot's state (``active | draining | retired |
safe_to_terminate``, ``joining`` for a grow). The same POST again with the same
``operation_id`` changes nothing and answers the same operation (``"repeated": true``).

Refusals: 400 for a malformed request or a slot outside the target, 404 for an unknown
operation, 409 when a scale runs, the change would leave no healthy rank or too few to
hold every expert, or the id names another request; 504 when membership does not
answer in time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from elasticep.frontend.api_errors import OpenAIError
from elasticep.frontend.core import Frontend
from elasticep.frontend.membership_source import (
    MembershipSource,
    ScaleInProgressError,
    ScaleNotSupportedError,
    ScaleRefusedError,
)
from elasticep.frontend.openai_protocol import ScaleRequest
from elasticep.membership.errors import OperationConflictError, OperationNotFoundError


async def _answer(call: Callable[[], Awaitable[dict[str, Any] | None]], param: str,
                  ) -> dict[str, Any]:
    """Run a membership call and turn its refusals into OpenAI errors."""
    try:
        return await call() or {}
    except OperationNotFoundError as exc:
        raise OpenAIError(404, str(exc), code="operation_not_found") from exc
    except OperationConflictError as exc:
        raise OpenAIError(409, str(exc), code="operation_conflict",
                          param="operation_id") from exc
    except ScaleInProgressError as exc:
        raise OpenAIError(409, str(exc), code="scale_in_progress") from exc
    except ScaleRefusedError as exc:
        raise OpenAIError(409, str(exc), code="scale_refused") from exc
    except (ScaleNotSupportedError, ValueError) as exc:
        raise OpenAIError(400, str(exc), param=param) from exc
    except asyncio.TimeoutError as exc:
        raise OpenAIError(504, "membership did not answer in time",
                          type="server_error") from exc


def _kind(req: ScaleRequest, result: dict[str, Any]) -> str | None:
    """What ``req`` was, from the coordinator's answer ``result`` (its size, not this
    front-end's snapshot of it): grow, shrink or retire; None for the size it has."""
    if req.new_ep_size is None:
        return "retire"
    old = result.get("old_ep_size", req.new_ep_size)
    if req.new_ep_size == old:
        return None
    return "grow" if req.new_ep_size > old else "shrink"


def add_scale_routes(app: FastAPI, frontend: Frontend) -> None:
    """Register the scale routes on ``app`` (see the module doc)."""

    @app.post("/scale_elastic_ep")
    async def scale(req: ScaleRequest) -> JSONResponse:
        which = req.which()
        op_id = req.operation_id
        if which == "new_ep_size":
            if req.keep_processes:
                raise OpenAIError(400, "keep_processes applies to retire_ranks and drain_node "
                                  "(a shrink's workers always exit)", param="keep_processes")
            max_ep = frontend.status().max_ep_size
            if req.new_ep_size < 1 or (max_ep and req.new_ep_size > max_ep):
                cap = f" (serve --max-ep-size {max_ep} caps growth)" if max_ep else ""
                raise OpenAIError(400, f"new_ep_size must be in [1, {max_ep}]{cap}, got "
                                  f"{req.new_ep_size}", param="new_ep_size")

            def change(m: MembershipSource) -> dict[str, Any] | None:
                return m.scale(req.new_ep_size, operation_id=op_id)
        else:
            def change(m: MembershipSource) -> dict[str, Any] | None:
                return m.retire(ranks=req.retire_ranks, node=req.drain_node,
                                operation_id=op_id, keep_processes=req.keep_processes)
        result = await _answer(lambda: frontend.change_membership(
            change, lambda answer: _kind(req, answer)), which)
        waiting = frontend.waiting_for_joiners()
        if result.get("scale_phase") == "waiting_for_joiners" and waiting is not None:
            result["waiting_for_joiners"] = waiting  # the grow needs `join`: say how
        asked = {which: getattr(req, which)}
        if req.keep_processes:
            asked["keep_processes"] = True
        if _kind(req, result) is None:  # the size it has: a no-op
            return JSONResponse({"status": "unchanged", **asked, **result, "message":
                                 f"ep_size is {req.new_ep_size} already: nothing to do"})
        return JSONResponse({"status": "accepted", **asked, **result})

    @app.get("/scale_elastic_ep/{operation_id}")
    async def operation(operation_id: str) -> JSONResponse:
        result = await _answer(lambda: frontend.operation(operation_id), "operation_id")
        return JSONResponse(result)
