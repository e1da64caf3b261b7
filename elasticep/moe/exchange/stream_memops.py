"""CUDA stream memory operations: a stream that waits on, or writes, a 32-bit word.

``cuStreamWaitValue32`` blocks a stream (not an SM) until a word in device memory holds a
value; ``cuStreamWriteValue32`` stores one from the stream's queue. Both can be captured
in a CUDA graph, which is what lets :mod:`elasticep.moe.exchange.ipc_exchange` wait for a peer's
rows inside the graph of a decode step. A wait's value is fixed when it is captured,
so a flag is written back to 0 after each wait (reset after use).

Measured on an H200 (bench/spike_stream_wait.py): 11 us per round trip between two
processes, and a stream blocked on a wait is released from a side stream of the same
process in about 0.1 ms.

The driver API comes from NVIDIA's ``cuda-bindings`` package (``pip install
cuda-bindings``; imported only when these functions are first called, so CPU machines
never need it).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def driver():
    """The ``cuda.bindings.driver`` module (or the older ``cuda.cuda`` layout).

    Raises:
        ImportError: neither is installed, naming the package to install.
    """
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        try:
            from cuda import cuda as drv  # cuda-python < 12.6
        except ImportError as exc:
            raise ImportError("CUDA stream memory operations need NVIDIA's cuda-bindings "
                              "package: pip install cuda-bindings") from exc
    return drv


def available() -> bool:
    """True when CUDA is usable and the driver bindings import."""
    if not torch.cuda.is_available():
        return False
    try:
        driver()
    except ImportError:
        return False
    return True


def _check(res: object) -> None:
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")


def _stream(stream: torch.cuda.Stream | None):
    s = stream if stream is not None else torch.cuda.current_stream()
    return driver().CUstream(s.cuda_stream)


def wait_value32(addr: int, value: int, stream: torch.cuda.Stream | None = None) -> None:
    """Enqueue on ``stream`` (default: the current one) a wait until the int32 at device
    address ``addr`` equals ``value``.

    Raises:
        RuntimeError: the driver refused the call.
    """
    drv = driver()
    _check(drv.cuStreamWaitValue32(_stream(stream), drv.CUdeviceptr(addr), value,
                                   drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ))


def _batch_param(kind: str, addr: int, value: int):
    """One ``CUstreamBatchMemOpParams``: ``kind`` "wait" (until ``== value``) or "write"."""
    drv = driver()
    p = drv.CUstreamBatchMemOpParams()
    if kind == "wait":
        p.operation = drv.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_32
        op, flags = p.waitValue, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
    else:
        p.operation = drv.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32
        op, flags = p.writeValue, drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    op.operation = p.operation
    op.address = drv.CUdeviceptr(addr)
    op.value = value
    op.flags = flags
    return p


def _batch_params(addrs: list[int], reset: bool) -> list:
    ops = []
    for addr in addrs:
        ops.append(_batch_param("wait", addr, 1))
        if reset:
            ops.append(_batch_param("write", addr, 0))
    return ops


def _batched(addrs: list[int], stream: torch.cuda.Stream | None, reset: bool = True) -> None:
    drv = driver()
    ops = _batch_params(addrs, reset)
    _check(drv.cuStreamBatchMemOp(_stream(stream), len(ops), ops, 0))


@functools.cache
def batch_works(device_index: int) -> bool:
    """Whether ``cuStreamBatchMemOp`` runs our wait-then-reset pairs in order, eagerly
    and inside a captured graph, on this device (a self-test, once per process).

    One batch node replaces two memop nodes per peer in a decode graph, and each node
    costs host time at every graph launch; where the test fails, the waits go one by
    one (same semantics).
    """
    try:
        with torch.cuda.device(device_index):
            flag = torch.ones(2, dtype=torch.int32, device="cuda")
            _batched([flag[0].data_ptr(), flag[1].data_ptr()], None)
            torch.cuda.synchronize()
            if flag.tolist() != [0, 0]:
                return False
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                _batched([flag[0].data_ptr()], None)
                flag[1].add_(5)
            flag.fill_(1)
            graph.replay()
            torch.cuda.synchronize()
            return flag.tolist() == [0, 6]
    except Exception:  # noqa: BLE001 - any failure means: do not use it
        return False


def wait_and_reset32(addrs: list[int], stream: torch.cuda.Stream | None = None,
                     reset: bool = True) -> None:
    """For each int32 at ``addrs`` in turn: wait until it equals 1, then write 0 (the
    exchange's per-peer flags), as one batched stream operation where
    :func:`batch_works`, else one or two operations per flag. ``reset=False`` leaves
    each flag set (the exchange's send kernels then clear it: ``reset_prev``).

    Raises:
        RuntimeError: the driver refused a call.
    """
    if not addrs:
        return
    if batch_works(torch.cuda.current_device()):
        _batched(addrs, stream, reset)
        return
    for addr in addrs:
        wait_value32(addr, 1, stream)
        if reset:
            write_value32(addr, 0, stream)


def write_value32(addr: int, value: int, stream: torch.cuda.Stream | None = None) -> None:
    """Enqueue on ``stream`` (default: the current one) a store of ``value`` to the int32
    at device address ``addr`` (with the default memory barrier: earlier writes of the
    stream are visible first).

    Raises:
        RuntimeError: the driver refused the call.
    """
    drv = driver()
    _check(drv.cuStreamWriteValue32(_stream(stream), drv.CUdeviceptr(addr), value,
                                    drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT))
