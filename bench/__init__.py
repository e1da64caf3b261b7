"""The benchmarks, a package run from the repository root: ``python -m bench.NAME``.

Run as modules, they import their shared helpers (``bench._deploy``, ``bench._procs``)
and ``elasticep_testkit`` from the repository without editing ``sys.path``.
"""
