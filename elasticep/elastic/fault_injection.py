"""Test-only fault injection: a rank SIGKILLs itself at a given step, admission or load,
or a request poisons every rank that runs it.

Spec (``ELASTICEP_FAULT`` environment variable, or ``WorkerConfig.fault``)::

    kill:rank=2:step=10            # rank 2 dies before the forward of its step 10
    kill:rank=2:step=10:layer=3    # ... inside step 10, when MoE layer 3 is entered
                                   #     (mid-dispatch for the other ranks)
    kill:rank=2:admit=1            # rank 2 dies in the 1st admission it takes part in
                                   #     as a survivor, after the placement is shared
                                   #     and before the joiners' experts arrive
    kill:rank=2:admit_start=1      # ... in its 1st admission, before the placement is
                                   #     shared (the joiners are members by then)
    kill:rank=2:loading            # rank 2 dies while loading: its weights are read,
                                   #     it has not registered with the coordinator
    raise:seed=666                 # any rank whose step holds a request with seed 666
                                   #     raises PoisonFault before the forward (a step
                                   #     that crashes on one request's account)

Several specs may be joined with ``,``. A step is one working lockstep step (idle
iterations with no work anywhere are not counted); every rank counts the same steps,
so "step 10" names the same moment everywhere. The kill is a real ``SIGKILL`` of the
process itself, so nothing is flushed or closed: exactly what a crash looks like to
the survivors. A relaunched rank restarts its count at 0 but only fires a spec whose
rank and step it reaches again; the deployment never passes ``WorkerConfig.fault`` to
relaunches (``$ELASTICEP_FAULT`` is inherited, so a ``raise`` spec there poisons
relaunched ranks too, as a real poison request would).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV_VAR = "ELASTICEP_FAULT"


class PoisonFault(RuntimeError):
    """Raised by a ``raise:seed=N`` spec in a step that holds a request with seed N."""


@dataclass(frozen=True)
class FaultSpec:
    """One parsed fault: ``rank`` dies at ``step`` (optionally at MoE ``layer``), in its
    ``admit``-th admission (after the placement is shared; ``admit_start``: before), or
    while ``loading`` (then ``step`` is None); or, with ``poison_seed`` set (``rank``
    None), a step holding a request of that seed raises."""

    rank: int | None
    step: int | None
    layer: int | None = None
    admit: int | None = None
    loading: bool = False
    poison_seed: int | None = None
    admit_start: int | None = None


def parse_faults(text: str | None) -> list[FaultSpec]:
    """Parse ``"kill:rank=R:step=S[:layer=L]"`` / ``"kill:rank=R:admit=N"`` /
    ``"kill:rank=R:admit_start=N"`` / ``"kill:rank=R:loading"`` / ``"raise:seed=N"``
    specs joined by commas.

    Returns:
        The specs, in order; empty for None or "".

    Raises:
        ValueError: on an unknown action, a missing or non-integer field.
    """
    specs = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        action, *fields = part.split(":")
        if action == "raise":
            specs.append(_parse_poison(part, fields))
            continue
        if action != "kill":
            raise ValueError(f"fault spec {part!r}: only 'kill' and 'raise' are supported")
        kv = {}
        loading = "loading" in fields
        for f in fields:
            if f == "loading":
                continue
            key, sep, value = f.partition("=")
            if not sep or key not in ("rank", "step", "layer", "admit", "admit_start"):
                raise ValueError(f"fault spec {part!r}: bad field {f!r}")
            try:
                kv[key] = int(value)
            except ValueError:
                raise ValueError(f"fault spec {part!r}: {key} must be an integer") from None
        whens = ("step" in kv) + ("admit" in kv) + ("admit_start" in kv) + loading
        if "rank" not in kv or whens != 1 or ("layer" in kv and "step" not in kv):
            raise ValueError(f"fault spec {part!r}: needs rank= and one of step= "
                             f"(optionally with layer=), admit=, admit_start= or loading")
        specs.append(FaultSpec(kv["rank"], kv.get("step"), kv.get("layer"), kv.get("admit"),
                               loading, admit_start=kv.get("admit_start")))
    return specs


def _parse_poison(part: str, fields: list[str]) -> FaultSpec:
    """``raise:seed=N`` (the fields after the action).

    Raises:
        ValueError: any other field, or a non-integer seed.
    """
    key, sep, value = fields[0].partition("=") if len(fields) == 1 else ("", "", "")
    if key != "seed" or not sep:
        raise ValueError(f"fault spec {part!r}: 'raise' takes exactly seed=N")
    try:
        return FaultSpec(None, None, poison_seed=int(value))
    except ValueError:
        raise ValueError(f"fault spec {part!r}: seed must be an integer") from None


class FaultInjector:
    """Fires this rank's faults. Call :meth:`at_loading` between reading the weights and
    registering, :meth:`at_step` before each step's forward, :meth:`at_layer` when a MoE
    layer is entered, :meth:`at_admit_start` and :meth:`at_admit` before and after an
    admission shares the placement.

    Args:
        rank: this process's rank; specs for other ranks are ignored.
        specs: parsed specs (see :func:`parse_faults`).
    """

    def __init__(self, rank: int, specs: list[FaultSpec]) -> None:
        self.rank = rank
        self.specs = [s for s in specs if s.rank == rank]
        self.poison_seeds = {s.poison_seed for s in specs if s.poison_seed is not None}
        self.step = -1
        self.admissions = 0
        self.admission_starts = 0

    @classmethod
    def from_config(cls, rank: int, fault: str | None) -> FaultInjector:
        """Specs from ``fault`` (the worker config) plus ``$ELASTICEP_FAULT``."""
        return cls(rank, parse_faults(fault) + parse_faults(os.environ.get(ENV_VAR)))

    def at_loading(self) -> None:
        """The weights are read, the rank has not registered; dies if a spec says so."""
        if any(s.loading for s in self.specs):
            self._die("loading")

    def at_step(self, step: int) -> None:
        """Enter working step ``step``; dies here if a spec without a layer matches."""
        self.step = step
        if any(s.step == step and s.layer is None for s in self.specs):
            self._die(f"step {step}")

    def at_batch(self, seeds: Iterable[int | None]) -> None:
        """Before a step's forward, given its requests' seeds.

        Raises:
            PoisonFault: a ``raise`` spec names one of ``seeds``.
        """
        hit = self.poison_seeds.intersection(seeds)
        if hit:
            logger.warning("fault injection: rank %d raises on a request with seed %s",
                           self.rank, min(hit))
            raise PoisonFault(f"fault injection: poison request (seed {min(hit)})")

    @property
    def has_layer_faults(self) -> bool:
        """True when a spec names a layer (only then must :meth:`at_layer` be called)."""
        return any(s.layer is not None for s in self.specs)

    def at_layer(self, layer: int) -> None:
        """Enter MoE layer ``layer`` of the current step; dies if a spec matches."""
        if any(s.step == self.step and s.layer == layer for s in self.specs):
            self._die(f"step {self.step} layer {layer}")

    def at_admit_start(self) -> None:
        """An admission began on a survivor (joiners admitted, placement not shared)."""
        self.admission_starts += 1
        if any(s.admit_start == self.admission_starts for s in self.specs):
            self._die(f"the start of admission {self.admission_starts}")

    def at_admit(self) -> None:
        """Mid-admission on a survivor (placement shared, experts not yet moved)."""
        self.admissions += 1
        if any(s.admit == self.admissions for s in self.specs):
            self._die(f"admission {self.admissions}")

    def _die(self, where: str) -> None:
        logger.warning("fault injection: rank %d SIGKILLs itself at %s", self.rank, where)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)
