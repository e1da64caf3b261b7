"""Random fault schedules from a seed (pure), and their one-line text form.

A schedule is what one chaos trial does to a healthy EP deployment under load: one or
more faults, each started ``at_s`` seconds after the previous one finished. The same
(seed, trial, ep_size, kinds) always gives the same schedule, and
``Schedule.parse(s.describe()) == s``, so a violation's reproducer is one line.

Fault kinds (``ranks`` are the slots they hit; ``param_s`` as noted):

* ``kill``: SIGKILL one rank (rank 0 included);
* ``freeze``: SIGSTOP one rank, SIGCONT after ``param_s`` (below or above the heartbeat
  timeout: a hiccup or an eviction);
* ``double-kill``: SIGKILL two ranks ``param_s`` apart (near-simultaneous);
* ``kill-during-recovery``: SIGKILL the second rank ``param_s`` after the coordinator
  reported the first one failed, while survivors reconcile;
* ``joiner-dies``: SIGKILL a rank, relaunch it with `join recover`, SIGKILL the joiner
  ``param_s`` after its worker started (loading or being admitted);
* ``scale-while-failing``: a scale joiner for the first free slot gets ready, a rank is
  SIGKILLed, ``param_s`` later ``POST /scale_elastic_ep`` asks for one more rank;
* ``occupied-join``: `join recover` for a healthy rank: must be refused with a clear error.

Kinds of a 2-node deployment with its membership in etcd (``--nnodes 2``, whose
schedules draw from :data:`HOST_KINDS` only):

* ``leader-kill``: SIGKILL the coordinator replica that leads (no rank: ``ranks=``
  is empty); a standby must lead within the lease TTL and a second, the ranks resume
  with it in place;
* ``node-0-host-kill``: SIGKILL every process of node 0 (serve, front-end, replica,
  ranks: ``ranks`` are node 0's), wait until the survivors committed an epoch without
  them, then start node 0's `serve` again, which must take its slots back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("kill", "freeze", "double-kill", "kill-during-recovery", "joiner-dies",
         "scale-while-failing", "occupied-join")
# victims each kind takes out of the membership (occupied-join takes none)
HOST_KINDS = ("leader-kill", "node-0-host-kill")  # with --nnodes 2 (etcd) only
ALL_KINDS = KINDS + HOST_KINDS
_VICTIMS = {"kill": 1, "freeze": 1, "double-kill": 2, "kill-during-recovery": 2,
            "joiner-dies": 1, "scale-while-failing": 1, "occupied-join": 1,
            "leader-kill": 0}
_KILLS = {"occupied-join": 0}


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule.

    Attributes:
        kind: one of :data:`ALL_KINDS`.
        ranks: the slots it hits.
        at_s: seconds after the previous fault (or the load start) it begins.
        param_s: the kind's timing parameter (see the module docstring), seconds.
    """

    kind: str
    ranks: tuple[int, ...]
    at_s: float
    param_s: float = 0.0

    def describe(self) -> str:
        """``kind:ranks=a+b:at=S:p=S``."""
        return (f"{self.kind}:ranks={'+'.join(map(str, self.ranks))}:at={self.at_s:.2f}"
                f":p={self.param_s:.2f}")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """Inverse of :meth:`describe`.

        Raises:
            ValueError: unknown kind or malformed field.
        """
        try:
            kind, ranks, at, p = text.strip().split(":")
            if kind not in ALL_KINDS or not ranks.startswith("ranks=") \
                    or not at.startswith("at=") or not p.startswith("p="):
                raise ValueError
            return cls(kind, tuple(int(r) for r in ranks[6:].split("+") if r), float(at[3:]),
                       float(p[2:]))
        except ValueError:
            raise ValueError(f"bad fault {text!r}; expected KIND:ranks=R[+R]:at=S:p=S "
                             f"with KIND in {ALL_KINDS}") from None


@dataclass(frozen=True)
class Schedule:
    """The faults of one trial, run in order."""

    faults: tuple[Fault, ...]

    def describe(self) -> str:
        """Faults joined by ``;`` (the reproducer's ``--schedule`` value)."""
        return ";".join(f.describe() for f in self.faults)

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """Inverse of :meth:`describe` (raises ValueError like :meth:`Fault.parse`)."""
        faults = tuple(Fault.parse(part) for part in text.split(";") if part.strip())
        if not faults:
            raise ValueError("empty schedule")
        return cls(faults)

    def victims(self) -> set[int]:
        """Slots taken out of the membership over the whole schedule."""
        return {r for f in self.faults if f.kind != "occupied-join" for r in f.ranks}

    def leaves_survivors(self, ep_size: int) -> bool:
        """True when some rank of slots 0..ep_size-1 is never a victim, so the
        deployment can answer every request (every :func:`make_schedule` schedule)."""
        return bool(set(range(ep_size)) - self.victims())


def make_schedule(seed: int, trial: int, ep_size: int, heartbeat_timeout_s: float,
                  kinds: tuple[str, ...] = KINDS, max_faults: int = 2,
                  can_scale: bool = True, nnodes: int = 1) -> Schedule:
    """A random schedule for trial ``trial`` of run ``seed`` (pure, deterministic).

    At least two ranks always survive the whole trial (every victim is distinct), so
    the deployment can keep serving; any rank, rank 0 included, may be a victim.

    Args:
        seed, trial: the random stream (``random.Random(f"{seed}:{trial}")``).
        ep_size: ranks 0..ep_size-1 are healthy when the trial starts.
        heartbeat_timeout_s: the deployment's; freezes straddle it.
        kinds: fault kinds to draw from.
        max_faults: most faults in one trial (at least one).
        can_scale: False when the deployment has no free slot (no scale faults).
        nnodes: 1, or 2 for the 2-node etcd deployment, which takes only
            :data:`HOST_KINDS` (node 0 holds slots ``0..ep_size/2-1``).

    Raises:
        ValueError: ``ep_size`` < 3, or no usable kind.
    """
    if ep_size < 3:
        raise ValueError(f"chaos needs ep_size >= 3 (two survivors), got {ep_size}")
    allowed = HOST_KINDS if nnodes > 1 else KINDS
    usable = [k for k in kinds if k in allowed and (can_scale or k != "scale-while-failing")]
    node0 = tuple(range(ep_size // max(1, nnodes)))
    if not usable:
        raise ValueError(f"no usable fault kind among {kinds}")
    rng = random.Random(f"{seed}:{trial}")
    budget = ep_size - 2  # victims allowed in this trial
    used: set[int] = set()
    faults: list[Fault] = []
    for _ in range(rng.randint(1, max_faults)):
        fits = [k for k in usable if _KILLS.get(k, _VICTIMS.get(k, len(node0))) <= budget
                and not (k == "node-0-host-kill" and used & set(node0))]
        if not fits:
            break
        kind = rng.choice(fits)
        pool = sorted(set(range(ep_size)) - used)
        ranks = node0 if kind == "node-0-host-kill" else tuple(rng.sample(pool, _VICTIMS[kind]))
        if kind == "freeze":
            param = heartbeat_timeout_s * rng.choice((0.3, 2.0))  # hiccup or eviction
        elif kind in ("double-kill", "scale-while-failing"):
            param = rng.uniform(0.0, 0.2)
        elif kind == "kill-during-recovery":
            param = rng.uniform(0.0, 0.05)
        elif kind == "joiner-dies":
            param = rng.uniform(0.1, 3.0)
        else:
            param = 0.0
        faults.append(Fault(kind, ranks, round(rng.uniform(0.5, 3.0), 2), round(param, 2)))
        if kind != "occupied-join":
            used |= set(ranks)
            budget -= len(ranks)
        if kind == "scale-while-failing":
            # the deployment reserves one free slot, so a trial can scale up only once
            usable.remove(kind)
    return Schedule(tuple(faults))
