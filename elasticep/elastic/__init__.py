"""elastic layer: the lockstep multi-rank worker and its failure / rejoin / scale flows.

- ``worker``: ``python -m elasticep.elastic.worker --config-json JSON``, one rank;
  ``exit_code``: its exit statuses (``ExitCode``).
- ``step_loop``: LockstepLoop (header, schedule, execute, commit, redo on failure).
- ``placement_sync``: agreed placement changes (repair, admit, drain, rebalance).
- ``rank_model``: a rank's weights, its EP executor, the checkpoint expert reader.
- ``fault_injection``: ``ELASTICEP_FAULT=kill:rank=R:step=S[:layer=L]`` (or ``admit=N``,
  or ``loading``).
- ``log_context``: rank and epoch on every worker log line.
- ``step_profiler``: ``ELASTICEP_TORCH_PROFILER_DIR=DIR``: each rank profiles a window of
  working steps and writes ``DIR/rank{r}.json`` and ``DIR/rank{r}.trace.json``.

Starting, relaunching and scaling the worker processes is ``elasticep.deploy``'s job.
See docs/ELASTIC.md.
"""
