"""The pieces of ``bench/serving.py`` (a benchmark in the shape of SGLang's
``bench_serving``), kept here so tests and other benches can use them:

- ``datasets``: the requests of a run (random token ids or text, GSM8K);
- ``client``: an asyncio streaming client of ``/v1/completions`` with Poisson arrivals
  and a concurrency cap, every SSE event timestamped;
- ``metrics``: the summary (throughput; TTFT, TPOT, ITL, E2E mean/median/p99), pure;
- ``engine_baseline``: the same requests through the in-process ``LLMEngine``;
- ``stub_engine``: stub ranks that emit tokens at a set rate behind the real front-end.
"""
