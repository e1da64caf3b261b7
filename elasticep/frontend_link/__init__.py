"""The link between the HTTP front-end and the worker ranks: its messages
(`messages`) and the pyzmq channels that carry them (`channels`: `FrontendChannel` on
the front-end, `WorkerChannel` on each rank).

It sits above `engine` (its messages carry the engine's request types) and below
everything that serves: the worker loops, the deployment, the front-end, the commands.
"""

from .channels import (
    FrontendChannel,
    FrontendUnreachableError,
    LinkError,
    RankUnreachableError,
    WorkerChannel,
)
from .messages import (
    AbortOrigin,
    FirstTokenTimes,
    LinkEndpoints,
    OutputBatch,
    RankMessage,
    RankStats,
    RequestError,
    StepFailed,
    WorkerHello,
    WorkerMessage,
    is_routable,
    monotonic_us,
)

__all__ = [
    "AbortOrigin", "FirstTokenTimes", "FrontendChannel", "FrontendUnreachableError",
    "LinkEndpoints", "LinkError", "OutputBatch",
    "RankMessage", "RankStats", "RankUnreachableError", "RequestError", "StepFailed",
    "WorkerChannel", "WorkerHello", "WorkerMessage", "is_routable", "monotonic_us",
]
