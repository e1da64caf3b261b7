"""A warning for each garbage collection that stops the process longer than a threshold
(SGLang's ``--gc-warning-threshold-secs``): a collection holds the GIL, so a front-end's
event loop or a rank's step loop stands still meanwhile, and a long one shows up as a
first-token or inter-token latency spike with no other trace in the logs."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_installed: list[Callable[[str, dict], None]] = []


def warn_long_collections(threshold_s: float) -> bool:
    """Log a WARNING (generation, seconds, objects collected) for every collection of
    this process that lasts longer than ``threshold_s`` seconds, from now on; a second
    call replaces the first one's threshold.

    Args:
        threshold_s: seconds; 0 or less installs nothing (and removes an earlier hook).

    Returns:
        Whether a hook is installed now.
    """
    for cb in _installed:
        gc.callbacks.remove(cb)
    _installed.clear()
    if threshold_s <= 0:
        return False
    started = [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took > threshold_s:
            logger.warning("garbage collection of generation %d took %.3g s (over %g s; "
                           "%d objects collected)", info["generation"], took, threshold_s,
                           info["collected"])

    gc.callbacks.append(on_collection)
    _installed.append(on_collection)
    return True
