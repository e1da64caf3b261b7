"""Keep a long-lived server's start-up objects out of the garbage collector's scans.

A front-end process imports torch, transformers and the tokenizer before it serves:
millions of objects that live as long as the process. CPython's oldest-generation
collection walks every tracked object, so under load one such collection paused a
front-end's event loop for about 140 ms on a 2-core machine (every stream's tokens and
every new request waiting; ``docs/results/cpu-i50t/``). :func:`gc.freeze` (CPython 3.7+)
moves every object alive now into a permanent generation that collections skip (vLLM and
SGLang freeze their processes' heaps after start-up likewise). Objects made later are
collected as before, and a frozen object whose last reference goes is still freed.
Only reference cycles among the frozen objects are never collected, so this is for
processes whose start-up state lives until exit (not for the ranks, whose CUDA graphs
may be captured again and must then be collectable).
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive (:func:`gc.freeze`); call when the
    process has finished starting and is about to serve.

    Returns:
        How many objects are frozen now (:func:`gc.get_freeze_count`).
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze %d start-up objects out of the garbage collector's scans", frozen)
    return frozen


def thaw_startup_heap() -> None:
    """Undo :func:`freeze_startup_heap` (:func:`gc.unfreeze`); call before a process that
    froze its heap ends through a normal interpreter exit. That exit skips the permanent
    generation, so extension objects frozen there are never freed, and nanobind's
    bindings (triton's) then print a report of hundreds of "leaked" objects on stderr. A
    process that ends with ``os._exit`` needs none of it."""
    gc.unfreeze()
