"""Lab tool: the demo tokenizer's encode of the benchmark's 256-token prompts, alone and
with a CPU-bound Python thread beside it (a busy event loop's stand-in), through
transformers' ``encode`` and the Rust tokenizer's own; one JSON line (ms per prompt:
wall, and the encoding thread's CPU). Run from the repository root."""
import json
import os
import resource
import sys
import threading
import time

sys.path.insert(0, os.getcwd())
from bench._commit import commit  # noqa: E402
from elasticep.frontend.tokenizer import load_tokenizer  # noqa: E402
from elasticep_testkit.paths import DEMO_MODEL  # noqa: E402
from elasticep_testkit.serving.datasets import random_requests  # noqa: E402

tok = load_tokenizer(DEMO_MODEL)
prompts = [r.prompt for r in random_requests(200, 256, 1, 1.0, 1, tok, len(tok))]
calls = {"transformers": tok.encode, "rust": lambda p: tok.backend_tokenizer.encode(p).ids}


def thread_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def timed(encode, busy: bool) -> dict:
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
    if busy:
        spinner.start()
    t0, c0 = time.perf_counter(), thread_cpu()
    for p in prompts:
        encode(p)
    wall, cpu = time.perf_counter() - t0, thread_cpu() - c0
    stop.set()
    if busy:
        spinner.join()
    return {"wall_ms": round(wall / len(prompts) * 1e3, 3),
            "cpu_ms": round(cpu / len(prompts) * 1e3, 3)}


for p in prompts[:5]:
    tok.encode(p)
out = {"bench": "gil_encode", "commit": commit(), "prompts": len(prompts),
       "chars_max": max(map(len, prompts)), "load1": os.getloadavg()[0]}
for name, encode in calls.items():
    out[name] = {"alone": timed(encode, False), "beside_a_busy_thread": timed(encode, True)}
print(json.dumps(out))
