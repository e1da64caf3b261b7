"""Opt-in stand-in for Mooncake's ``mooncake`` package: only ``mooncake.pg``, served by
ElasticEP's elastic backend (`elasticep.compat.mooncake`). Install it only where the
real Mooncake is not installed: both provide the top-level name ``mooncake``."""
