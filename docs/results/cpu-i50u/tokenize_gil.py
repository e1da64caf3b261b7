"""Lab probe (not product code): what encoding a 300-token prompt costs the front-end's
thread. Times transformers' `encode` and the Rust backend's `encode` / `encode_batch`
alone, then each while a pure-Python thread spins (the event loop's stand-in): a call
that keeps the GIL slows the spinner; one that releases it must win it back.

    PYTHONPATH=$PWD python docs/results/cpu-i50u/tokenize_gil.py
"""
import threading
import time

from transformers import AutoTokenizer

from elasticep_testkit.paths import DEMO_MODEL

tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
backend = tok.backend_tokenizer
text = "hello world " * 100
calls = {"transformers encode": lambda: tok.encode(text),
         "backend encode": lambda: backend.encode(text).ids,
         "backend encode_batch": lambda: backend.encode_batch([text])[0].ids}
assert calls["transformers encode"]() == calls["backend encode"]()
N = 400
for name, f in calls.items():
    f()
    t0 = time.perf_counter()
    for _ in range(N):
        ids = f()
    print(f"{name}: {1e6 * (time.perf_counter() - t0) / N:.0f} us alone, {len(ids)} tokens")

count, stop = [0], [False]


def spin() -> None:
    while not stop[0]:
        count[0] += 1


def spinner_rate(during) -> tuple[float, float]:
    stop[0], count[0] = False, 0
    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.2)
    c0, t0 = count[0], time.perf_counter()
    during()
    dt = time.perf_counter() - t0
    c1 = count[0]
    stop[0] = True
    t.join()
    return dt, (c1 - c0) / dt


dt, rate = spinner_rate(lambda: time.sleep(0.5))
print(f"spinner alone: {rate / 1e6:.2f} M iterations/s")
for name in ("backend encode", "backend encode_batch"):
    f = calls[name]
    dt, rate = spinner_rate(lambda f=f: [f() for _ in range(N)])
    print(f"{name} beside the spinner: {1e6 * dt / N:.0f} us a call, spinner "
          f"{rate / 1e6:.2f} M iterations/s")
