"""Compatibility layers that let code written for other process-group backends run on
`elasticep.distributed` unchanged: `mooncake` (Mooncake PG's Python API) and
`parallel_state` (SGLang's GroupCoordinator over elastic groups)."""
