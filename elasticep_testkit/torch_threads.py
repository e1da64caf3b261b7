"""One intra-op torch thread for a block, for the tests' and benches' small CPU models."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(1)``, then restore the count.

    With other processes on a 2-core machine (the CI's), OpenMP's spinning threads make
    the demo model's small matrix products about 30 times slower than one thread does.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
