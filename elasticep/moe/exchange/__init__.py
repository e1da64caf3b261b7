"""The token exchanges of expert parallelism: they move rows between ranks and compute
nothing on them.

- ``uneven_exchange``: replica choice (static / dynamic) and the ``all_to_all_single``
  exchange with uneven splits (the CPU path).
- ``padded_exchange``: the fixed-capacity ``all_to_all`` (no host sync).
- ``ipc_exchange``, ``ipc_buffers``, ``ipc_kernels``, ``stream_memops``: the same-host
  exchange over CUDA IPC, its memory (own buffers, mapped peers, pointer table), its send
  kernels, and the stream waits and writes on its flags.
"""
