"""Typed errors of the elastic backend.

Hierarchy::

    ElasticError(RuntimeError)
      EpochChangedError          membership changed under an op; redo the step
        RankFailureError         ... because ranks died (dead_ranks, epoch)
      RankEvictedError           this process is no longer a member (frozen too long)
        RankRemovedError         ... because deactivate_ranks removed it (planned)
      CoordinatorLostError       the control connection to the coordinator broke
    MembershipStoreError(RuntimeError)  the durable store (--membership-store) failed
      StoreUnavailableError      no endpoint answered (unreachable, or no quorum)
      FencedCommitError          another leader committed since this one read (deposed)
      PrefixInUseError           another deployment owns the store prefix
"""

from __future__ import annotations


class ElasticError(RuntimeError):
    """Base class of every error raised by elasticep.distributed."""


class EpochChangedError(ElasticError):
    """The group moved to a new epoch and the current op cannot be completed consistently.

    Attributes:
        epoch: the new epoch (int).
    """

    def __init__(self, message: str, epoch: int) -> None:
        super().__init__(message)
        self.epoch = epoch


class RankFailureError(EpochChangedError):
    """Ranks died during (or before) this op; the survivors all raise it from the same op.

    Attributes:
        dead_ranks: group ranks (slots) declared failed by the transition, sorted.
        epoch: the epoch the survivors now run in.
    """

    def __init__(self, dead_ranks: list[int], epoch: int, group: str = "") -> None:
        super().__init__(
            f"ranks {sorted(dead_ranks)} of group {group!r} failed; now at epoch {epoch}", epoch
        )
        self.dead_ranks = sorted(dead_ranks)


class RankEvictedError(ElasticError):
    """This process was declared failed (e.g. frozen past the heartbeat timeout) or removed.

    Its slot may already be relaunched; it must exit and never use its results.
    """


class RankRemovedError(RankEvictedError):
    """This rank was removed by a planned `deactivate_ranks`; its next op raises this.

    ``keep_process``: the removal asked its process to stay up, idle (a retirement with
    ``keep_processes``), instead of exiting.
    """

    def __init__(self, message: str, keep_process: bool = False) -> None:
        super().__init__(message)
        self.keep_process = keep_process


class CoordinatorLostError(ElasticError):
    """The control connection to the coordinator broke (coordinator gone)."""


class MembershipRequestError(ValueError):
    """The coordinator refused a supervisor's membership request (scale, join).

    ``code`` names the refusal on the wire, so the client can raise the same subclass.
    """

    code = "refused"


class ScaleInProgressError(MembershipRequestError):
    """A membership change is already running (HTTP 409)."""

    code = "scale_in_progress"


class ScaleRefusedError(MembershipRequestError):
    """A scale would empty the deployment (leave no healthy rank) (HTTP 409)."""

    code = "scale_refused"


class JoinRefusedError(MembershipRequestError):
    """A slot cannot be joined in the asked mode (occupied, out of range, being joined)."""

    code = "join_refused"


class ScaleNotSupportedError(MembershipRequestError):
    """This deployment cannot change its size (HTTP 400)."""

    code = "scale_not_supported"


class OperationNotFoundError(MembershipRequestError):
    """No scale or retire operation has this id (HTTP 404)."""

    code = "operation_not_found"


class OperationConflictError(MembershipRequestError):
    """An operation id is reused for another request (HTTP 409)."""

    code = "operation_conflict"


class MembershipStoreError(RuntimeError):
    """The durable membership store (``--membership-store``) refused or failed a call."""


class StoreUnavailableError(MembershipStoreError):
    """No store endpoint answered in time: all unreachable, or no quorum."""


class FencedCommitError(MembershipStoreError):
    """A commit was refused because the state changed since this coordinator last read
    it: another leader committed, so this one is deposed and must not act on its view."""


class PrefixInUseError(MembershipStoreError):
    """Another deployment already keeps its membership under this store prefix."""
