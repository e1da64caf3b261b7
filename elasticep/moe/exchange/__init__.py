"""The token exchanges of expert parallelism: they move rows between ranks and run no
expert and no router on them.

Each follows the contract of DeepEP's (and Mooncake EP's) buffers: a dispatch of the
hidden states to the ranks of their physical slots returns the received rows with their
local-slot tags and a small handle that carries the layout; the combine takes the expert
outputs, that handle and the combine weights, and returns one row per token (the
weighted sum of its k outputs, :mod:`~elasticep.moe.exchange.pair_combine`). Unlike
Mooncake EP's, no call takes the membership: an elastic group zero-fills inactive
ranks' blocks, and the same-host exchange keeps its mask in device memory.

- ``uneven_exchange``: replica choice (static / dynamic) and the ``all_to_all_single``
  exchange with uneven splits (the CPU path).
- ``padded_exchange``: the fixed-capacity ``all_to_all`` (no host sync).
- ``ipc_exchange``, ``ipc_buffers``, ``ipc_kernels``, ``stream_memops``: the same-host
  exchange over CUDA IPC, its memory (own buffers, mapped peers, pointer table), its send
  kernels, and the stream waits and writes on its flags.
- ``pair_combine``: the weighted sum that ends every combine (torch form and kernel).
"""
