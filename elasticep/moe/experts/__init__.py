"""The expert compute: SwiGLU kernel families over rows tagged with their local slot,
each beside its torch reference.

- ``expert_compute``: the entry points every executor shares (``grouped_swiglu``,
  ``run_expert_rows``) and the choice among the families below.
- ``small_batch_experts``: one matrix-vector product per (row, expert) pair.
- ``sorted_experts``: rows sorted by slot, each expert read once.
- ``tiled_experts``: the tiled grouped GEMM of prefill-sized batches.
- ``fp8_block``, ``fp8_activations``: block-FP8 weights and per-token FP8 activations.
- ``fp8_rows``, ``fp8_sorted``: the FP8-weight twins of the per-row and sorted kernels.
- ``fp8_tiles``: their launch tiles, from measured tables per device
  (``tile_configs/``), or first guesses.
- ``fp8_tiled``: prefill-sized FP8 batches on FP8 tensor cores (W8A8).
"""
