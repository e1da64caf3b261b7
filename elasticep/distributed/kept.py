"""Kept results: how a survivor that missed an op gets its result from a donor.

A member keeps the results of its last fetchable ops (`op_run.KEEP` of them). When a
failure decision names it the donor of an op another survivor did not complete, it
publishes that result in the coordinator's store under :func:`key`; the survivor
fetches it from there (:func:`fetch`) instead of redoing the op without the dead rank.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from datetime import timedelta

import torch

SLICE = timedelta(milliseconds=50)


def key(group: str, epoch: int, seq: int) -> str:
    """The store key of op ``seq``'s result, published for failure epoch ``epoch``."""
    return f"elastic/{group}/e{epoch}/kept/{seq}"


def publish(store, name: str, result: list[torch.Tensor]) -> None:
    """Put ``result`` (its CPU copies: a CUDA tensor would load onto the donor's device
    index) under store key ``name``."""
    buf = io.BytesIO()
    torch.save([t.cpu() for t in result], buf)
    store.set(name, buf.getvalue())


def fetch(store, name: str, check: Callable[[], None], deadline: float,
          what: str) -> list[torch.Tensor]:
    """Wait for store key ``name`` and load its tensors (on the CPU).

    Args:
        check: called between waits; raises to stop waiting (eviction, a newer decision).
        deadline: ``time.monotonic()`` by which it must have arrived.
        what: names the result in the timeout's message.

    Raises:
        TimeoutError: the result did not arrive by ``deadline``.
    """
    while True:
        try:
            store.wait([name], SLICE)
            break
        except Exception:
            pass
        check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} never arrived")
    return torch.load(io.BytesIO(store.get(name)), weights_only=True)
