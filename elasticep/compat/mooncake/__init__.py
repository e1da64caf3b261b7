"""Mooncake PG's Python API on the elastic backend: ``from elasticep.compat.mooncake import pg``.

Importing `pg` registers the torch.distributed backends "mooncake" and "mooncake-cpu".
The opt-in top-level package in ``compat/mooncake`` (``pip install ./compat/mooncake``)
makes ``from mooncake import pg`` resolve here, also in workers started by ``mp.spawn``.
"""
