"""moe layer: expert executors behind the model's MoE blocks.

- ``local_executor``: the single-rank executor (all experts on this rank).
- ``dispatch``: replica choice (static / dynamic) and the ``all_to_all_single`` exchange.
- ``ep_executor``: :class:`~elasticep.moe.ep_executor.EPMoEExecutor`, the EP executor
  (dispatch, local slots, combine) and ``apply_placement`` after a placement change
  (its caller supplies the commit point: ``elastic.placement_sync.commit_placement``).
"""
