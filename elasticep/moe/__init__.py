"""moe layer: expert executors behind the model's MoE blocks, in three rooms.

- ``executor``: the :class:`ExpertExecutor` protocol the model's MoE blocks call.
- ``local_executor``: the single-rank executor (all experts on this rank).
- ``ep_executor``: :class:`~elasticep.moe.ep_executor.EPMoEExecutor`, the EP executor
  (dispatch, local slots, combine), swapped to a new placement by ``set_placement``
  (``elastic.placement_sync.commit_placement`` runs the change: plan, move, commit, swap).
- ``cuda_executor``: the EP executor for CUDA (padded or same-host exchange, grouped
  expert kernels).
- ``softmax_topk``: the routing rule of one router row (device function and reference).
- ``weight_transfer`` and ``peer_weights``: moving expert weights as a placement
  change's load plan says, over the CPU group or device to device between ranks of one
  host.
- ``exchange/``: the transports (uneven and padded ``all_to_all``, the CUDA IPC
  exchange with its send kernels and stream memory operations).
- ``experts/``: the expert kernel families (per-row GEMV, sorted rows, tiled grouped
  GEMM, the fused combine) with their torch references.
"""
