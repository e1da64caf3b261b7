"""Speed at real scale: decode step time against the HBM bound, and against transformers.

A model of a real shape (default: Qwen3-30B-A3B, ``bench/configs/qwen3-30b-a3b.json``)
with ``--load-format dummy`` weights, so nothing is downloaded. Every request has a
``--prompt-len``-token prompt of random ids and decodes exactly ``--decode-tokens``
tokens (``ignore_eos``; the counts are asserted). One JSON line per configuration.

Sections (``--only``, comma-separated):

* ``hbm``: the HBM bandwidth of this GPU, from a large device-to-device copy, counted as
  ``2 x bytes copied / time`` (each byte is read once and written once);
* ``ep1``: our engine in this process (``LLMEngine``, every expert local) at each
  ``--batches`` size;
* ``ep2``: two ranks, one GPU each, through the deployment (``BatchDriver``: coordinator,
  worker processes, the front-end's routing); the batch is split evenly over the ranks;
  backends ``elastic`` and ``none`` interleaved, ``--repeats`` runs each, medians and
  spread;
* ``hf``: transformers ``generate`` against our engine on the same ``--hf-layers``-layer
  checkpoint (written to local disk by transformers itself), batch 1 and 16;
* ``profile``: ``torch.profiler`` over a few decode steps of ``ep1`` at batch
  ``--profile-batch``: GPU time by kind (attention, experts, exchange, sampling, other)
  and host time the GPU sat idle between kernels;
* ``prefill``: prefill tokens/s against the compute bound (FLOPs over the bf16 matmul
  rate measured in the same run) for ``--prefill-lens`` prompts at each
  ``--prefill-budgets`` step budget, the same 2048 tokens in three compositions, and a
  profile of one 8192-token step by kernel kind (``bench/prefill.py`` has the formula);
* ``ep2profile``: the same figures from inside each EP2 rank: a deployment launched as
  ``ep2`` launches it, per ``--profile-batch`` size, ``--profile-backends`` backend and
  ``--cuda-graph`` mode, with each rank's step profiler on
  (``ELASTICEP_TORCH_PROFILER_DIR``, window ``--profile-steps``); one decode run, then
  one row per rank (its summary, the unprofiled step time just before the window, and
  the path of its chrome trace under ``--workdir``).

The HBM bound of one decode step is the time to read, once, the bytes that step cannot
avoid reading, at the bandwidth ``bw`` measured in the same run::

    bytes = L_attn * (|W_q| + |W_k| + |W_v| + |W_o|) * s        attention weights
          + (shared experts, dense MLP layers) * s                   dense MLPs
          + sum over MoE layers of n_touched(layer) * 3 * H * I * s   experts routed this step
          + L_moe * E * H * s                                        routers
          + L * sum over sequences of ctx_len * 2 * Hkv * D * s      KV cache read
          + V * H * s                                                LM head
    bound_s = bytes / bw

with ``s`` the bytes of the dtype (for an FP8 model's FP8 weights, the experts and the
dense projections, 1 byte plus 4 per 128 x 128 block's scale: ``bench/step_bytes.py``),
``n_touched`` the distinct experts the step's tokens were routed to (measured), and
``ctx_len`` each sequence's context at that step. Norms,
embeddings of the new tokens and the writes of new K/V are under 0.1% and left out.
For EP2 the bound is that of the busier rank: its sequences' KV, the whole attention and
LM head (every rank holds them), and its half of the touched experts.

Usage::

    python -m bench.scale --only hbm,ep1 --layers 48 --batches 1,16,64,256
    python -m bench.scale --only ep2 --layers 48 --repeats 5
    python -m bench.scale --only hf --hf-layers 4
    python -m bench.scale --only ep2profile --layers 48 --profile-batch 1 --cuda-graph on
    python -m bench.scale --only prefill --layers 48 --prefill-lens 512,2048,8192,32768
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench._commit import commit

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
import torch

from bench.prefill import section_prefill
from bench.step_bytes import step_bytes
from elasticep.elastic.step_profiler import DIR_ENV, STEPS_ENV, profiler_settings
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.models import MoEModelConfig, load_model_config
from elasticep.moe.executor import ExecutorDefaults
from elasticep.utils.profile_summary import summarize_profile

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "bench" / "configs" / "qwen3-30b-a3b.json"


OUT_FILE: Path | None = None  # --out: every line is appended as it is printed


def emit(row: dict) -> None:
    """Print one JSON line (the bench's output) and flush it; append it to --out too,
    so a run cut short by a time limit keeps what it measured."""
    print(json.dumps(row), flush=True)
    if OUT_FILE is not None:
        with OUT_FILE.open("a") as f:
            f.write(json.dumps(row) + "\n")


def model_dir(config: Path, layers: int | None, root: Path) -> Path:
    """A directory holding only ``config.json`` (``num_hidden_layers`` set to ``layers``)."""
    raw = json.loads(config.read_text())
    if layers:
        raw["num_hidden_layers"] = layers
    d = root / f"{config.stem}-L{raw['num_hidden_layers']}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw, indent=1))
    return d


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hbm_bandwidth(device: str, gib: float = 4.0, reps: int = 20) -> float:
    """Bytes per second of a ``gib``-GiB device-to-device copy, counting read + write."""
    if not device.startswith("cuda"):
        gib, reps = 0.25, 5  # the --device cpu dry run only checks the script
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)  # random, never zeros
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)


def peak_memory_gib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def reset_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class RoutingRecorder(ExecutorDefaults):
    """Wraps a model's executor; while ``on``, keeps each MoE layer's ``topk_ids``.

    Recording adds no sync: the ids are copied on the device and counted afterwards. It
    routes nothing itself (``route_and_run`` is the default's None), so every layer
    passes it the ids.
    """

    def __init__(self, inner) -> None:
        self.inner = inner
        self.on = False
        self.ids: dict[int, torch.Tensor] = {}

    def __call__(self, layer_idx, hidden_states, topk_ids, topk_weights):
        if self.on:
            self.ids[layer_idx] = topk_ids.clone()
        return self.inner(layer_idx, hidden_states, topk_ids, topk_weights)

    @property
    def graph_safe(self) -> bool:
        """Replay captured graphs except on the recorded step (a graph would not record)."""
        return not self.on and bool(getattr(self.inner, "graph_safe", False))

    def touched(self) -> list[int]:
        return [int(torch.unique(t).numel()) for _, t in sorted(self.ids.items())]


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (batch, prompt_len), generator=gen).tolist()


def run_engine(engine: LLMEngine, prompts: list[list[int]], decode_tokens: int,
               recorder: RoutingRecorder | None = None) -> dict:
    """All prompts as one batch; step times split into prefill and pure decode steps."""
    params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
    tag = f"r{time.monotonic_ns()}-"
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"{tag}{i}", tuple(p), params))
    counts = dict.fromkeys(range(len(prompts)), 0)
    prefill_s, decode_steps, touched, ctx_at_record = 0.0, [], None, None
    while engine.has_unfinished():
        batch = engine.schedule()
        is_decode = all(it.end - it.start == 1 for it in batch.items)
        record = (recorder is not None and is_decode and touched is None
                  and len(decode_steps) == decode_tokens // 2)
        if recorder is not None:
            recorder.on, recorder.ids = record, {}
        t0 = time.perf_counter()
        outs = engine.commit(batch, engine.execute(batch))  # .tolist() inside: synced
        dt = time.perf_counter() - t0
        if record:
            recorder.on = False
            touched = recorder.touched()
            ctx_at_record = [it.end for it in batch.items]
        if is_decode:
            decode_steps.append(dt)
        else:
            prefill_s += dt
        for o in outs:
            counts[int(o.request_id[len(tag):])] += 1
    assert all(n == decode_tokens for n in counts.values()), counts
    return {"prefill_s": prefill_s, "decode_steps_s": decode_steps, "touched": touched,
            "ctx_lens": ctx_at_record}


def section_hbm(args) -> dict:
    bw = hbm_bandwidth(args.device)
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    row = {"section": "hbm", "hbm_bytes_per_s": bw, "hbm_tb_per_s": round(bw / 1e12, 3),
           "gpu": gpu}
    emit(row)
    return row


def _engine(mdir: Path, batch: int, args, dtype: torch.dtype, load_format: str,
            cuda_graph: bool = True) -> LLMEngine:
    total = batch * (args.prompt_len + args.decode_tokens) + 64 * 16
    return LLMEngine.from_pretrained(
        mdir, dtype=dtype, device=args.device, progress=False, load_format=load_format,
        config=EngineConfig(max_total_tokens=total, max_num_seqs=max(batch, 1),
                            max_batch_tokens=args.max_batch_tokens,
                            enable_cuda_graph=cuda_graph))


def section_ep1(args, bw: float) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    mdir = model_dir(Path(args.config), args.layers, Path(args.workdir))
    cfg = load_model_config(mdir)
    rows = []
    for batch in args.batches:
        for graphs in args.cuda_graph_modes:
            reset_memory(args.device)
            try:
                row = _ep1_one(args, mdir, cfg, dtype, batch, bw, graphs)
            except Exception as exc:  # noqa: BLE001 - one failed configuration, not the run
                row = {"section": "ep1", "batch": batch, "cuda_graph": graphs,
                       "error": f"{type(exc).__name__}: {exc}"[:2000]}
            emit(row)
            rows.append(row)
    return rows


def _ep1_one(args, mdir: Path, cfg: MoEModelConfig, dtype: torch.dtype, batch: int,
             bw: float, cuda_graph: bool) -> dict:
    """One batch size on a fresh engine; everything it loaded is freed on return."""
    t0 = time.perf_counter()
    engine = _engine(mdir, batch, args, dtype, "dummy", cuda_graph)
    load_s = time.perf_counter() - t0
    rec = RoutingRecorder(engine.model.executor)
    engine.model.executor = rec
    prompts = random_prompts(batch, args.prompt_len, cfg.vocab_size)
    run_engine(engine, prompts[:1], 2)  # warm-up: allocator, kernels, autotuning
    res = run_engine(engine, prompts, args.decode_tokens, rec)
    step = statistics.median(res["decode_steps_s"])
    parts = step_bytes(cfg, dtype.itemsize, res["touched"], res["ctx_lens"])
    bound = parts["total"] / bw
    return {"section": "ep1", "config": Path(args.config).stem, "layers": cfg.num_hidden_layers,
            "batch": batch, "cuda_graph": engine.runner.graphs is not None,
            "cuda_graph_capture_s": engine.cuda_graph_capture_s, "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens,
            "decode_step_ms": round(step * 1e3, 3),
            "decode_step_ms_p10_p90": [round(x * 1e3, 3) for x in _p10_p90(res["decode_steps_s"])],
            "decode_tokens_per_s": round(batch / step, 1),
            "prefill_tokens_per_s": round(batch * args.prompt_len / res["prefill_s"], 1),
            "peak_gpu_mem_gib": peak_memory_gib(args.device),
            "experts_touched_per_layer_mean": round(statistics.mean(res["touched"]), 1),
            "experts_per_layer": cfg.num_experts,
            "hbm_bound_ms": round(bound * 1e3, 4),
            "x_hbm_bound": round(step / bound, 2),
            "step_bytes": parts, "load_s": round(load_s, 1)}


def _p10_p90(xs: list[float]) -> tuple[float, float]:
    s = sorted(xs)
    return s[len(s) // 10], s[(len(s) * 9) // 10]


def section_profile(args) -> list[dict]:
    """:func:`profile_one` for each ``--profile-batch`` and CUDA-graph mode."""
    return [profile_one(args, b, graphs) for b in args.profile_batches
            for graphs in args.cuda_graph_modes]


def profile_one(args, b: int, graphs: bool) -> dict:
    """Where a decode step's time goes, by kernel kind, plus host gaps between kernels."""
    from torch.profiler import ProfilerActivity, profile

    dtype = getattr(torch, args.dtype)
    mdir = model_dir(Path(args.config), args.layers, Path(args.workdir))
    cfg = load_model_config(mdir)
    engine = _engine(mdir, b, args, dtype, "dummy", graphs)
    prompts = random_prompts(b, args.prompt_len, cfg.vocab_size)
    params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"p{i}", tuple(p), params))
    while True:  # through the prefill and a few decode steps
        batch = engine.schedule()
        engine.commit(batch, engine.execute(batch))
        if all(it.end - it.start == 1 for it in batch.items):
            break
    for _ in range(3):
        engine.step()
    n = 5
    sync(args.device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            engine.step()
        sync(args.device)
        wall_s = time.perf_counter() - t0  # inside: the profiler's stop parses its events
    del engine
    reset_memory(args.device)
    row = {"section": "profile", "batch": b, "layers": cfg.num_hidden_layers,
           "cuda_graph": graphs, **summarize_profile(prof, n, wall_s)}
    emit(row)
    return row


def _write_hf_checkpoint(args, root: Path) -> Path:
    """A ``--hf-layers``-layer checkpoint written by transformers itself (its default
    init, bf16), so both engines read the same weights from disk."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(Path(args.config).read_text())
    raw["num_hidden_layers"] = args.hf_layers
    d = root / f"hf-{Path(args.config).stem}-L{args.hf_layers}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw))
    cfg = AutoConfig.from_pretrained(str(d))
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(d))
    del model
    reset_memory(args.device)
    return d


def section_hf(args) -> list[dict]:
    """transformers ``generate`` vs our engine, same checkpoint, same GPU, batch 1 and 16."""
    from transformers import AutoModelForCausalLM

    ckpt = _write_hf_checkpoint(args, Path(args.workdir))
    cfg = load_model_config(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).to(args.device)
    hf.eval()
    rows = []
    for batch in args.hf_batches:
        prompts = random_prompts(batch, args.prompt_len, cfg.vocab_size)
        ids = torch.tensor(prompts, device=args.device)

        def gen(n: int, ids: torch.Tensor = ids) -> float:
            sync(args.device)
            t0 = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
            sync(args.device)
            assert out.shape[1] == ids.shape[1] + n
            return time.perf_counter() - t0

        gen(2)
        t1, tn = gen(1), gen(args.decode_tokens)
        hf_step = (tn - t1) / (args.decode_tokens - 1)
        for graphs in args.cuda_graph_modes:
            engine = _engine(ckpt, batch, args, torch.bfloat16, "auto", graphs)
            run_engine(engine, prompts[:1], 2)
            ours = run_engine(engine, prompts, args.decode_tokens)
            our_step = statistics.median(ours["decode_steps_s"])
            del engine
            reset_memory(args.device)
            row = {"section": "hf", "layers": args.hf_layers, "batch": batch, "cuda_graph": graphs,
                   "transformers_decode_step_ms": round(hf_step * 1e3, 3),
                   "ours_decode_step_ms": round(our_step * 1e3, 3),
                   "transformers_decode_tokens_per_s": round(batch / hf_step, 1),
                   "ours_decode_tokens_per_s": round(batch / our_step, 1),
                   "ours_vs_transformers": round(hf_step / our_step, 2),
                   "transformers_version": __import__("transformers").__version__}
            emit(row)
            rows.append(row)
    return rows


def _ep_run(driver, prompts: list[list[int]], decode_tokens: int) -> dict:
    """One batch through the deployment; token arrival times give the decode rate."""
    params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    arrivals: list[tuple[float, int]] = []

    def on_event(i: int, ev) -> None:
        now = time.perf_counter()
        if ev.token_ids:
            first.setdefault(i, now)
            last[i] = now
            arrivals.append((now, len(ev.token_ids)))

    t0 = time.perf_counter()
    outs = driver.generate(prompts, params, timeout_s=900, on_event=on_event)
    bad = [(i, o.error, len(o.token_ids)) for i, o in enumerate(outs)
           if o.error or len(o.token_ids) != decode_tokens]
    assert not bad, bad[:3]
    lo, hi = max(first.values()), min(last.values())  # every request decoding
    n = sum(k for t, k in arrivals if lo < t <= hi)
    window = hi - lo
    step = window * len(prompts) / n if n else float("nan")
    return {"decode_step_s": step, "decode_tokens_per_s": n / window if window > 0 else 0.0,
            "prefill_tokens_per_s": len(prompts) * len(prompts[0]) / (lo - t0)}


def _settle_gpu_memory(device: str, timeout_s: float = 30.0) -> None:
    """Wait until the GPUs' free memory stops growing: closed workers' memory is released
    after their processes exit, and the next launch's baseline must not include it."""
    if not device.startswith("cuda"):
        return
    last = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free = [torch.cuda.mem_get_info(g)[0] for g in range(torch.cuda.device_count())]
        if free == last:
            return
        last = free
        time.sleep(1.0)


def _ep2_driver(args, mdir: Path, backend: str, batch: int, cuda_graph: bool = True,
                env: dict[str, str] | None = None):
    """A ``BatchDriver`` over a fresh EP2 deployment (``--load-format dummy``, one GPU
    per rank) sized for ``batch`` prompts split over the two ranks."""
    from elasticep.config import DeploymentConfig
    from elasticep.entrypoints.batch_driver import BatchDriver

    per_rank = -(-batch // 2)
    total = per_rank * (args.prompt_len + args.decode_tokens) + 64 * 16
    return BatchDriver.launch(
        DeploymentConfig(model=str(mdir), dtype=args.dtype, device=args.device,
                         ep_size=2, max_ep_size=2, load_format="dummy",
                         elastic_ep_backend=backend, max_total_tokens=total,
                         max_running_requests=max(per_rank, 1), disable_cuda_graph=not cuda_graph),
        lambda ids: "", env=env, ready_timeout_s=600)


def section_ep2(args, bw: float, touched_by_batch: dict[int, float]) -> list[dict]:
    mdir = model_dir(Path(args.config), args.layers, Path(args.workdir))
    cfg = load_model_config(mdir)
    dtype = getattr(torch, args.dtype)
    rows = []
    for batch in args.batches:
        per_rank = -(-batch // 2)
        prompts = random_prompts(batch, args.prompt_len, cfg.vocab_size)
        runs: dict[str, list[dict]] = {"elastic": [], "none": []}
        mem: dict[str, float] = {}
        drivers = {}
        try:
            for backend in runs:
                cuda = args.device.startswith("cuda")
                free0 = [torch.cuda.mem_get_info(g)[0] for g in range(2)] if cuda else [0, 0]
                drivers[backend] = _ep2_driver(args, mdir, backend, batch)
                _ep_run(drivers[backend], prompts[:2], 2)  # warm-up
                if cuda:
                    used = [free0[g] - torch.cuda.mem_get_info(g)[0] for g in range(2)]
                    mem[backend] = round(max(used) / 2**30, 2)
            for _ in range(args.repeats):  # interleaved A/B
                for backend, driver in drivers.items():
                    runs[backend].append(_ep_run(driver, prompts, args.decode_tokens))
        finally:
            for d in drivers.values():
                d.close()
            _settle_gpu_memory(args.device)
        touched = touched_by_batch.get(batch)
        bound = None
        if touched is not None:
            ctx = [args.prompt_len + args.decode_tokens // 2] * per_rank
            parts = step_bytes(cfg, dtype.itemsize,
                               [round(touched / 2)] * sum(cfg.moe_layers), ctx)
            bound = parts["total"] / bw
        for backend, rs in runs.items():
            steps = [r["decode_step_s"] for r in rs]
            step = statistics.median(steps)
            row = {"section": "ep2", "backend": backend, "layers": cfg.num_hidden_layers,
                   "batch": batch, "repeats": len(rs),
                   "decode_step_ms": round(step * 1e3, 3),
                   "decode_step_ms_min_max": [round(min(steps) * 1e3, 3), round(max(steps) * 1e3, 3)],
                   "decode_tokens_per_s": round(statistics.median(
                       r["decode_tokens_per_s"] for r in rs), 1),
                   "prefill_tokens_per_s": round(statistics.median(
                       r["prefill_tokens_per_s"] for r in rs), 1),
                   "gpu_mem_in_use_gib_busier_gpu": mem.get(backend),
                   "hbm_bound_ms": round(bound * 1e3, 4) if bound else None,
                   "x_hbm_bound": round(step / bound, 2) if bound else None}
            emit(row)
            rows.append(row)
        e = statistics.median(r["decode_tokens_per_s"] for r in runs["elastic"])
        n = statistics.median(r["decode_tokens_per_s"] for r in runs["none"])
        emit({"section": "ep2_ratio", "batch": batch, "elastic_vs_none_tokens_per_s": round(e / n, 3)})
    return rows


def section_ep2profile(args) -> list[dict]:
    """Each EP2 rank's own profile of a window of decode steps: one fresh deployment
    (launched as ``ep2`` launches it) per ``--profile-batch`` size, ``--profile-backends``
    backend and CUDA-graph mode, with ``ELASTICEP_TORCH_PROFILER_*`` set, one decode run;
    then one row per rank: the rank's summary
    (:mod:`elasticep.elastic.step_profiler`) plus where its chrome trace is."""
    from elasticep.utils.wait import wait_until

    skip, count = args.profile_steps
    if args.decode_tokens < skip + count + 2:  # + the prefill step(s), with a margin
        sys.exit(f"bench/scale.py: ep2profile profiles steps {skip}..{skip + count - 1}: "
                 f"--decode-tokens must be >= {skip + count + 2}, got {args.decode_tokens}")
    mdir = model_dir(Path(args.config), args.layers, Path(args.workdir))
    cfg = load_model_config(mdir)
    rows = []
    for batch in args.profile_batches:
        prompts = random_prompts(batch, args.prompt_len, cfg.vocab_size)
        for backend in args.profile_backends:
            for graphs in args.cuda_graph_modes:
                out = Path(tempfile.mkdtemp(prefix=f"ep2profile-b{batch}-{backend}-",
                                            dir=args.workdir))
                env = {DIR_ENV: str(out), STEPS_ENV: f"{skip}:{count}"}
                files = [out / f"rank{r}.json" for r in range(2)]
                try:
                    with _ep2_driver(args, mdir, backend, batch, graphs, env) as driver:
                        _ep_run(driver, prompts, args.decode_tokens)  # its rate holds the export
                        wait_until(lambda files=files: all(f.exists() for f in files), 120,
                                   f"both ranks' profiles in {out}")
                except Exception as exc:  # noqa: BLE001 - one failed configuration, not the run
                    row = {"section": "ep2profile", "backend": backend, "batch": batch,
                           "cuda_graph": graphs, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                    emit(row)
                    rows.append(row)
                    continue
                finally:
                    _settle_gpu_memory(args.device)
                for f in files:
                    row = {"section": "ep2profile", "backend": backend, "batch": batch,
                           "layers": cfg.num_hidden_layers, "cuda_graph": graphs,
                           **json.loads(f.read_text()), "trace": str(f.with_suffix(".trace.json"))}
                    emit(row)
                    rows.append(row)
    return rows


def _read_rows(path: str | None, section: str) -> list[dict]:
    if not path:
        return []
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("section") == section]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="a model's config.json")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="ep2: interleaved runs per backend")
    ap.add_argument("--max-batch-tokens", type=int, default=8192, help="prefill tokens per step")
    ap.add_argument("--hf-layers", type=int, default=4)
    ap.add_argument("--hf-batches", default="1,16")
    ap.add_argument("--profile-batch", default="1,64", help="batch sizes to profile")
    ap.add_argument("--profile-steps", default="20:10", metavar="SKIP:COUNT",
                    help="ep2profile: each rank skips SKIP working steps (the deployment "
                         "counts from its start; the run's prefill is among them), then "
                         "profiles COUNT")
    ap.add_argument("--profile-backends", default="elastic,none",
                    help="ep2profile: the backends to profile, one deployment each")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda",
                    help="cuda; cpu only dry-runs the script on a tiny --config")
    ap.add_argument("--only", default="hbm,hf,profile,ep1,ep2",
                    help="sections, run in this order (ep2's HBM bound needs ep1 first)")
    ap.add_argument("--workdir", default=None, help="where model dirs are written")
    ap.add_argument("--cuda-graph", choices=("on", "off", "both"), default="both",
                    help="ep1/hf/profile: decode CUDA graphs on, off (--disable-cuda-graph), "
                         "or both, one row each")
    ap.add_argument("--ep1-from", default=None,
                    help="ep2 without ep1 in this run: take the experts each batch touches "
                         "from this earlier JSONL output (same config, prompts and seed)")
    ap.add_argument("--out", default=None, help="also append every JSON line to this file")
    ap.add_argument("--prefill-lens", default="512,2048,8192,32768",
                    help="prefill: prompt lengths, tokens")
    ap.add_argument("--prefill-budgets", default="8192,16384",
                    help="prefill: step budgets (max_batch_tokens), tokens")
    ap.add_argument("--prefill-repeats", type=int, default=3, help="prefill: warm runs")
    ap.add_argument("--prefill-warmup", action="store_true",
                    help="prefill: run serve's prefill warm-up on each engine first")
    ap.add_argument("--chunked-prefill-size", type=int, default=None,
                    help="prefill: the engine's chunk size (default: no chunking)")
    args = ap.parse_args()
    args.prefill_lens = [int(x) for x in args.prefill_lens.split(",")]
    args.prefill_budgets = [int(x) for x in args.prefill_budgets.split(",")]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench/scale.py: --device cuda, but torch sees no CUDA device")
    args.batches = [int(x) for x in args.batches.split(",")]
    args.hf_batches = [int(x) for x in args.hf_batches.split(",")]
    args.profile_batches = [int(x) for x in args.profile_batch.split(",")]
    try:  # the ranks' own parser, so the bench takes exactly what they take
        ps = profiler_settings({DIR_ENV: ".", STEPS_ENV: args.profile_steps})
    except ValueError as exc:
        sys.exit(f"bench/scale.py: --profile-steps: {exc}")
    args.profile_steps = (ps.skip, ps.count)
    args.profile_backends = args.profile_backends.split(",")
    args.cuda_graph_modes = {"on": [True], "off": [False], "both": [True, False]}[args.cuda_graph]
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="elasticep-scale-")
    only = args.only.split(",")
    global OUT_FILE
    OUT_FILE = Path(args.out) if args.out else None
    meta = {"section": "meta", "commit": commit(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args)}
    emit(meta)
    bw = section_hbm(args)["hbm_bytes_per_s"]  # every bound needs it
    ep1: list[dict] = []
    for name in only:  # in the order given, so a long section can go last
        if name == "ep1":
            ep1 = section_ep1(args, bw)
        elif name == "hf":
            section_hf(args)
        elif name == "profile":
            section_profile(args)
        elif name == "ep2profile":
            section_ep2profile(args)
        elif name == "prefill":
            section_prefill(args, emit, model_dir(Path(args.config), args.layers,
                                                  Path(args.workdir)))
        elif name == "ep2":
            earlier = ep1 or _read_rows(args.ep1_from, "ep1")
            touched = {r["batch"]: r["experts_touched_per_layer_mean"] for r in earlier}
            section_ep2(args, bw, touched)
        elif name != "hbm":
            sys.exit(f"bench/scale.py: unknown section {name!r}")


if __name__ == "__main__":
    main()
