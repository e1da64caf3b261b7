"""CUDA tensors shared between processes of one host, as bytes for a rendezvous store.

A thin layer over torch's own CUDA IPC (``torch.multiprocessing.reductions``, the
mechanism behind sending CUDA tensors to a ``torch.multiprocessing`` child), so that
processes that never forked from each other can map one another's memory: the
producer puts :func:`share`'s bytes in a store, a consumer on the same host turns them
back into a tensor over the producer's memory with :func:`open_shared`.

Lifetime follows torch's rules (its note "CUDA IPC Refcounting implementation
explained"): every share adds one to a counter in host shared memory that a consumer's
open takes over and its release gives back, and memory the producer frees stays
allocated while the counter is above 0. A share that nobody opens would hold its
memory for the producer's lifetime, so a producer that publishes shares a consumer may
never open gives each one back itself (:func:`release`) once no consumer can still
need it.
"""

from __future__ import annotations

import pickle

import torch


def share(tensor: torch.Tensor) -> bytes:
    """The handle of a CUDA ``tensor`` (any shape and dtype) as bytes (a few hundred).

    Raises:
        RuntimeError: ``tensor`` is not on a CUDA device.
    """
    if tensor.device.type != "cuda":
        raise RuntimeError(f"only CUDA tensors can be shared, not {tensor.device}")
    from torch.multiprocessing.reductions import reduce_tensor
    _rebuild, args = reduce_tensor(tensor)
    return pickle.dumps(args)


def release(handle: bytes) -> None:
    """Give back the count of one :func:`share` (by the producer, for a share no consumer
    will open any more), so the memory is freed when the producer frees it."""
    args = pickle.loads(handle)
    # the tuple of torch.multiprocessing.reductions.reduce_tensor for a CUDA tensor:
    # (..., device [6], ..., ref_counter_handle [11], ref_counter_offset [12], ...)
    torch.UntypedStorage._release_ipc_counter(args[11], args[12], device=args[6])


def open_shared(handle: bytes) -> torch.Tensor:
    """The tensor of :func:`share`'s ``handle``, mapped over the producer's memory (same
    shape, dtype, strides and device index).

    Raises:
        RuntimeError: the producer's memory cannot be mapped (its process is gone, or it
            is on another host).
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    return rebuild_cuda_tensor(*pickle.loads(handle))
