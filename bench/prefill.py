"""Prefill speed against the compute bound: the ``prefill`` section of ``bench/scale.py``.

The compute bound of a prefill is the FLOPs it must do over the bf16 matrix rate of the
same GPU, measured in the same run (an ``8192^3`` bf16 ``torch.matmul`` on random data)::

    linear  = 2 x active_params_per_token x prompt tokens
    attn    = per sequence and layer, for a chunk [s, e) of its prompt:
              2 x heads x (d_qk + d_v) x (e^2 - s^2) / 2     (causal: query i sees i+1 keys)
    lm_head = 2 x V x H per sequence (only its last position's logits are computed)
    bound_s = (linear + attn + lm_head) / matmul_rate

For a block-FP8 checkpoint the rows add ``fp8_bound_s = linear / fp8_rate + (attn +
lm_head) / matmul_rate`` (its projections and experts run W8A8 on the FP8 tensor cores,
:func:`fp8_matmul_rate` measured in the same run; attention and the unconverted LM head
stay bf16; the routers, about 0.5% of ``linear``, are counted at the FP8 rate) and
``x_fp8_bound``.

``active_params_per_token`` counts every weight a token passes through: the attention
projections of every layer (MHA/GQA: q, k, v, o; MLA: its down/up projections,
:meth:`elasticep.models.mla.MLAConfig.weight_params`), ``top_k`` routed experts of
``3 x H x I`` and the router ``E x H`` on each MoE layer, the shared experts, and the
dense MLPs of dense layers. For Qwen3-30B-A3B that is 0.906 B + 1.81 B + 0.013 B =
2.73 B. With MHA/GQA ``d_qk = d_v = head_dim``; with MLA (the expanded prefill form)
``d_qk = qk_nope + qk_rope`` and ``d_v = v_head_dim``. Norms, RoPE, softmax and the
routing top-k are not counted (well under 1% of the FLOPs).

Each configuration is a set of equal prompts that fills one step budget (``budget //
prompt_len`` prompts; one prompt when it is longer than the budget) with ``max_tokens=1``,
run through ``LLMEngine`` until every request has its first token. The first run of a
shape is timed apart (``cold_s``: Triton compiles and autotunes there;
``cold_triton_compiles`` counts the kernels Triton compiled or loaded from its disk
cache meanwhile); then ``--prefill-repeats`` warm runs give the median. With
``--prefill-warmup`` each budget's engine first runs serve's warm-up
(:mod:`elasticep.engine.prefill_warmup`, a ``prefill_warmup`` row), so the cold runs
show what a served request would still pay. Rows: ``prefill`` (one per budget and
prompt length), ``prefill_mix`` (the same 2048 tokens as 1 x 2048, 4 x 512 and 16 x 128)
and ``prefill_profile`` (GPU time by kind of one warm 8192-token step, 4 x 2048). A
model with a shorter context (the CPU dry run on the demo model) uses half its context
in place of 2048.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import torch

from bench.gpu_run import _time_cuda  # one CUDA-event median timer (milliseconds)
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.prefill_warmup import count_triton_compiles, warm_up_prefill
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.models import MoEModelConfig, load_model_config
from elasticep.utils.profile_summary import busy_us, profile_spans

PREFILL_KINDS: dict[str, tuple[str, ...]] = {
    "attention": ("paged_attn", "mla", "flash", "fmha", "sdpa", "attn", "merge_splits"),
    "experts": ("sorted_gate_up", "sorted_down", "gate_up", "down_kernel", "grouped",
                "combine", "slot_rows"),
    "norms_routing": ("rms", "norm", "rope", "softmax_topk", "topk", "qkv_cache", "sort"),
    "projections": ("gemm", "nvjet", "sm90", "cutlass", "matmul", "gemv", "mm"),
}


def prefill_kind(name: str) -> str:
    """Kind of a kernel in a prefill step (first match of :data:`PREFILL_KINDS`, else
    ``"other"``). cuBLAS GEMMs are the projections, the LM head and the routers; the
    experts run in this repository's Triton kernels, which name themselves."""
    low = name.lower()
    return next((k for k, keys in PREFILL_KINDS.items() if any(x in low for x in keys)),
                "other")


def active_params_per_token(cfg: MoEModelConfig) -> dict[str, int]:
    """Weights one token passes through in a forward pass, by part (parameter counts)."""
    H, D = cfg.hidden_size, cfg.head_dim
    if cfg.mla is not None:
        attn = cfg.mla.weight_params(H)
    else:
        attn = 2 * cfg.num_attention_heads * D * H + 2 * cfg.num_key_value_heads * D * H
    n_moe = sum(cfg.moe_layers)
    return {
        "attention_projections": cfg.num_hidden_layers * attn,
        "routed_experts": n_moe * cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size,
        "routers": n_moe * cfg.num_experts * H,
        "dense_mlps": (n_moe * cfg.shared_expert_intermediate_size
                       + (cfg.num_hidden_layers - n_moe) * cfg.intermediate_size) * 3 * H,
    }


def attention_width(cfg: MoEModelConfig) -> tuple[int, int]:
    """(heads, d_qk + d_v) of one layer's prefill attention."""
    if cfg.mla is not None:
        return cfg.mla.num_heads, cfg.mla.qk_head_dim + cfg.mla.v_head_dim
    return cfg.num_attention_heads, 2 * cfg.head_dim


def prefill_flops(cfg: MoEModelConfig, prompt_lens: list[int]) -> dict[str, float]:
    """FLOPs of prefilling whole prompts of these lengths (tokens), by part."""
    per_token = sum(active_params_per_token(cfg).values())
    heads, width = attention_width(cfg)
    n = sum(prompt_lens)
    parts = {
        "linear": 2.0 * per_token * n,
        "attention": sum(2.0 * cfg.num_hidden_layers * heads * width * p * p / 2
                         for p in prompt_lens),
        "lm_head": 2.0 * cfg.vocab_size * cfg.hidden_size * len(prompt_lens),
    }
    parts["total"] = sum(parts.values())
    return parts


def matmul_rate(device: str, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of an ``n^3`` bf16 matmul on random data (median of ``reps`` after 3
    warm-ups, timed with CUDA events). On CPU a small fp32 product, to check the script."""
    if not device.startswith("cuda"):
        a = torch.randn(256, 256)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ a
        return 2 * 256**3 * reps / (time.perf_counter() - t0)
    ab = [torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2)]
    seconds = _time_cuda(lambda: ab[0] @ ab[1], reps) / 1e3
    ab.clear()
    torch.cuda.empty_cache()
    return 2 * n**3 / seconds


def fp8_matmul_rate(device: str, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of an ``n^3`` float8_e4m3fn product on the FP8 tensor cores, timed as
    :func:`matmul_rate`: ``torch._scaled_mm`` with one scale per operand (the plainest
    FP8 GEMM cuBLAS runs), float32 accumulation without fast accumulation (as the
    blockwise W8A8 products accumulate), bf16 out, random data. CUDA only."""
    # the right operand column-major, as cuBLASLt's FP8 products take it on Hopper
    ab = [torch.randn(n, n, device=device).to(torch.float8_e4m3fn),
          torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()]
    one = torch.ones((), device=device)
    seconds = _time_cuda(lambda: torch._scaled_mm(*ab, one, one, out_dtype=torch.bfloat16),
                         reps) / 1e3
    ab.clear()
    torch.cuda.empty_cache()
    return 2 * n**3 / seconds


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_prefill(engine: LLMEngine, prompts: list[list[int]], device: str) -> tuple[float, int]:
    """Prefill ``prompts`` (one sampled token each); (seconds, engine steps)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    tag = f"pf{time.monotonic_ns()}-"
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"{tag}{i}", tuple(p), params))
    _sync(device)
    t0 = time.perf_counter()
    steps, got = 0, 0
    while engine.has_unfinished():
        batch = engine.schedule()
        got += len(engine.commit(batch, engine.execute(batch)))  # .tolist(): synced
        steps += 1
    dt = time.perf_counter() - t0
    if got != len(prompts):
        raise RuntimeError(f"prefill gave {got} first tokens for {len(prompts)} prompts")
    return dt, steps


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=gen).tolist()


def _engine(mdir: Path, budget: int, longest: int, dtype: torch.dtype, device: str,
            chunk: int | None) -> LLMEngine:
    extra = {"chunked_prefill_size": chunk} if chunk else {}
    cfg = EngineConfig(max_total_tokens=max(budget, longest) + 4096, max_num_seqs=256,
                       max_batch_tokens=budget, enable_cuda_graph=False, **extra)
    return LLMEngine.from_pretrained(mdir, dtype=dtype, device=device, progress=False,
                                     load_format="dummy", config=cfg)


def _mix_tokens(cfg: MoEModelConfig) -> int:
    """2048, or less where the model's context is shorter (the tiny CPU model)."""
    return min(2048, cfg.max_position_embeddings // 2)


def _timed(engine: LLMEngine, prompts: list[list[int]], device: str, repeats: int) -> dict:
    with count_triton_compiles() as compiles:  # in-memory misses: the disk cache hides some
        cold_s, _ = run_prefill(engine, prompts, device)
    warm = [run_prefill(engine, prompts, device) for _ in range(repeats)]
    times = [t for t, _ in warm]
    return {"cold_s": cold_s, "cold_triton_compiles": compiles.count,
            "warm_s": statistics.median(times),
            "warm_s_min_max": [min(times), max(times)], "steps": warm[0][1]}


def section_prefill(args, emit: Callable[[dict], None], mdir: Path) -> list[dict]:
    """Rows ``prefill``, ``prefill_mix`` and ``prefill_profile`` (module docstring).

    ``args`` carries ``device``, ``dtype``, ``prefill_lens`` and ``prefill_budgets``
    (lists of token counts), ``prefill_repeats`` and ``chunked_prefill_size`` (None:
    the engine's default, no chunking).
    """
    dtype = getattr(torch, args.dtype)
    cfg = load_model_config(mdir)
    rate = matmul_rate(args.device)
    fp8_rate = (fp8_matmul_rate(args.device) if cfg.quantization is not None
                and args.device.startswith("cuda") else None)
    emit({"section": "matmul", "bf16_tflop_per_s": round(rate / 1e12, 1),
          "fp8_tflop_per_s": None if fp8_rate is None else round(fp8_rate / 1e12, 1)})
    rows = []

    def one(engine: LLMEngine, section: str, budget: int, n: int, length: int) -> dict:
        prompts = _prompts(n, length, cfg.vocab_size, seed=length)
        res = _timed(engine, prompts, args.device, args.prefill_repeats)
        flops = prefill_flops(cfg, [length] * n)
        bound = flops["total"] / rate
        tokens = n * length
        row = {"section": section, "layers": cfg.num_hidden_layers, "budget": budget,
               "prompts": n, "prompt_len": length, "tokens": tokens, "steps": res["steps"],
               "tokens_per_s": round(tokens / res["warm_s"], 1),
               "ms_per_1k_tokens": round(res["warm_s"] * 1e6 / tokens, 2),
               "warm_s": round(res["warm_s"], 4),
               "warm_s_min_max": [round(x, 4) for x in res["warm_s_min_max"]],
               "cold_s": round(res["cold_s"], 4),
               "cold_triton_compiles": res["cold_triton_compiles"],
               "compute_bound_s": round(bound, 4), "x_compute_bound": round(res["warm_s"] / bound, 2),
               "tflop": round(flops["total"] / 1e12, 2),
               "achieved_tflop_per_s": round(flops["total"] / res["warm_s"] / 1e12, 1)}
        if fp8_rate is not None:
            fp8_bound = (flops["linear"] / fp8_rate
                         + (flops["attention"] + flops["lm_head"]) / rate)
            row.update(fp8_bound_s=round(fp8_bound, 4),
                       x_fp8_bound=round(res["warm_s"] / fp8_bound, 2))
        emit(row)
        rows.append(row)
        return row

    longest = max(args.prefill_lens)
    for budget in args.prefill_budgets:
        engine = _engine(mdir, budget, longest, dtype, args.device, args.chunked_prefill_size)
        if getattr(args, "prefill_warmup", False):  # what serve does before its ready line
            rep = warm_up_prefill(engine)
            if rep is not None:
                emit({"section": "prefill_warmup", "budget": budget, "steps": rep.steps,
                      "seconds": round(rep.seconds, 2), "triton_compiles": rep.triton_compiles,
                      "token_counts": rep.token_counts})
        for length in args.prefill_lens:
            one(engine, "prefill", budget, max(1, budget // length), length)
        if budget == args.prefill_budgets[0]:
            total = _mix_tokens(cfg)
            for n in (1, 4, 16):
                one(engine, "prefill_mix", budget, n, total // n)
            rows.append(profile_step(engine, args, cfg, emit, rate))
            rows.append(profile_cold(engine, args, cfg, emit))
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def profile_step(engine: LLMEngine, args, cfg: MoEModelConfig,
                 emit: Callable[[dict], None], rate: float) -> dict:
    """GPU time by :func:`prefill_kind` of one warm 4 x 2048-token prefill, beside its
    compute bound at ``rate`` FLOP/s."""
    from torch.profiler import ProfilerActivity, profile

    length = _mix_tokens(cfg)
    prompts = _prompts(4, length, cfg.vocab_size, seed=7)
    run_prefill(engine, prompts, args.device)  # warm this exact shape
    acts = [ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        wall_s, steps = run_prefill(engine, prompts, args.device)
    kernels, host = profile_spans(prof)
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for s in kernels:
        us = s.end_us - s.start_us
        k = prefill_kind(s.name)
        by_kind[k] = by_kind.get(k, 0.0) + us
        by_name[s.name[:80]] = by_name.get(s.name[:80], 0.0) + us
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    # one middle layer's kernels in launch order (two residual norms a layer), so a kind's
    # time can be pinned to its place in the layer
    ordered = sorted(kernels, key=lambda k: k.start_us)
    norms = [i for i, k in enumerate(ordered) if "add_rms_norm" in k.name]
    mid = len(norms) // 2 & ~1
    layer = ordered[norms[mid]:norms[mid + 2]] if len(norms) > mid + 2 else []
    # where the GPU waits on the host: before the first kernel, and the longest idle
    # stretches between kernels (each named by the kernel that ends it)
    t0 = min((h.start_us for h in host), default=ordered[0].start_us if ordered else 0.0)
    gaps = sorted(((b.start_us - a.end_us, b.name[:60]) for a, b in pairwise(ordered)),
                  reverse=True)[:8]
    bound = prefill_flops(cfg, [length] * 4)["total"] / rate
    row = {"section": "prefill_profile", "tokens": 4 * length, "steps": steps,
           "wall_ms": round(wall_s * 1e3, 2),
           "gpu_busy_ms": round(busy_us(kernels) / 1e3, 2),
           "gpu_ms_by_kind": {k: round(v / 1e3, 2) for k, v in sorted(by_kind.items())},
           "kernels": len(kernels),
           "top_kernels_ms": [[n, round(us / 1e3, 3)] for n, us in top],
           "one_layer_us": [[k.name[:60], round(k.end_us - k.start_us, 1)] for k in layer],
           "first_kernel_after_ms": round((ordered[0].start_us - t0) / 1e3, 2) if ordered else None,
           "last_kernel_end_ms": round((ordered[-1].end_us - t0) / 1e3, 2) if ordered else None,
           "longest_gaps_ms": [[round(g / 1e3, 3), n] for g, n in gaps],
           "compute_bound_ms": round(bound * 1e3, 2)}
    emit(row)
    return row


def _triton_cache() -> set[str]:
    """Names of the kernels in Triton's on-disk cache (one ``NAME.json`` per compiled
    variant, under a hash directory), as ``hash/NAME``."""
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    if not root.is_dir():
        return set()
    return {f"{p.parent.name[:8]}/{p.stem}" for p in root.glob("*/*.json")
            if not p.name.startswith("__grp__")}


def profile_cold(engine: LLMEngine, args, cfg: MoEModelConfig,
                 emit: Callable[[dict], None]) -> dict:
    """What the host does in the first prefill of a composition not seen before
    (8 x 256 tokens): its wall time beside a warm run, and the host events that took
    the most time (compilation shows there), to find what compiles on the request path."""
    from torch.profiler import ProfilerActivity, profile

    from elasticep.utils.profile_summary import summarize_spans

    prompts = _prompts(8, min(256, _mix_tokens(cfg) // 8), cfg.vocab_size, seed=11)
    before = _triton_cache()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cold_s, _ = run_prefill(engine, prompts, args.device)
    compiled = sorted(_triton_cache() - before)
    warm_s, _ = run_prefill(engine, prompts, args.device)
    kernels, host = profile_spans(prof)
    summary = summarize_spans(kernels, 1, cold_s, host)
    row = {"section": "prefill_cold_profile", "prompts": len(prompts),
           "prompt_len": len(prompts[0]), "cold_ms": round(cold_s * 1e3, 2),
           "warm_ms": round(warm_s * 1e3, 2), "triton_compiled": compiled,
           "host_top_ms": summary.get("host_top_ms_per_step", [])[:12]}
    emit(row)
    return row
