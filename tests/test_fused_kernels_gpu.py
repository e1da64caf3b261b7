"""The decode-path Triton kernels against their torch references (GPU only; CI has no GPU).

- :func:`add_rms_norm` / :func:`rms_norm` against the residual add plus
  :func:`elasticep.models.layers.rms_norm`;
- :func:`norm_rope` (Qwen3's q/k norm then RoPE) against ``apply_rope(rms_norm(x))``,
  and :func:`qkv_norm_rope_cache` (q/k norm, RoPE and the KV-cache writes in one
  kernel) against norm_rope plus the cache writes;
- :func:`swiglu_rows` (per-row expert GEMV) against the per-slot matmul loop, with
  padding rows and repeated slots, and with its tag bound against the exchange's clamp;
- :func:`swiglu_tiled` (the prefill-sized grouped GEMM) against the per-slot loop, and
  ``grouped_swiglu`` taking it at prefill sizes;
- :func:`fused_combine` (gather, weight, sum of each token's k outputs) against the
  torch form of :func:`combine_pairs`.
In fp32 they must agree to rounding; in bf16, to a few units in the last place.
"""

from __future__ import annotations

import pytest
import torch

from elasticep.models.fused_norm_rope import add_rms_norm, norm_rope, rms_norm
from elasticep.models.layers import rms_norm as rms_norm_reference
from elasticep.models.rope import apply_rope
from elasticep.moe.experts.expert_compute import grouped_swiglu
from elasticep.moe.experts.small_batch_experts import MAX_ROWS, small_batch_ok, swiglu_rows
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2048), (7, 2048), (3, 300), (5, 4, 128)])
def test_add_rms_norm_matches_reference(dtype, shape):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, generator=g, device="cuda").to(dtype)
    d = torch.randn(shape, generator=g, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g, device="cuda")).to(dtype)
    h, y = add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(h, x + d)  # the add rounds exactly as torch's
    assert _rel(y, rms_norm_reference(x + d, w, 1e-6)) < TOL[dtype]
    assert _rel(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)) < TOL[dtype]
    h0, y0 = add_rms_norm(x, None, w, 1e-6)
    assert h0 is x or torch.equal(h0, x)


# 9 / 5 tokens: a program a head; 200: the block kernels (BLOCK_KERNEL_MIN_TOKENS)
@pytest.mark.parametrize("T", [9, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_rope_matches_reference(dtype, with_norm, T):
    g = torch.Generator(device="cuda").manual_seed(1)
    heads, D = 4, 128
    x = torch.randn(T, heads, D, generator=g, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(D, generator=g, device="cuda")).to(dtype) if with_norm else None
    pos = torch.arange(T, device="cuda", dtype=torch.float32)[:, None] * 37
    inv = 1e6 ** (-torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D)
    ang = torch.cat([pos * inv, pos * inv], dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    ref = apply_rope(rms_norm_reference(x, w, 1e-6) if with_norm else x, cos, sin)
    assert _rel(norm_rope(x, w, 1e-6, cos, sin), ref) < TOL[dtype]
    # a strided slice of a fused qkv output, read in place
    fused = torch.randn(T, heads * D + 3 * D, generator=g, device="cuda").to(dtype)
    xs = fused[:, D:D + heads * D].view(T, heads, D)
    ref = apply_rope(rms_norm_reference(xs, w, 1e-6) if with_norm else xs, cos, sin)
    assert _rel(norm_rope(xs, w, 1e-6, cos, sin), ref) < TOL[dtype]


@pytest.mark.parametrize("T", [5, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
def test_qkv_norm_rope_cache_matches_norm_rope_and_cache_writes(dtype, with_norm, T):
    """The one-kernel form against norm_rope on q and k plus the two index_copy writes;
    cache slots not written keep their contents."""
    from elasticep.models.fused_norm_rope import qkv_cache_ok, qkv_norm_rope_cache

    g = torch.Generator(device="cuda").manual_seed(2)
    hq, hkv, D, slots = 8, 2, 128, 256
    qkv_full = torch.randn(T, (hq + 2 * hkv) * D + 16, generator=g, device="cuda").to(dtype)
    qkv = qkv_full[:, :(hq + 2 * hkv) * D]  # strided tokens, as a slice would give
    wq = (1 + 0.1 * torch.randn(D, generator=g, device="cuda")).to(dtype) if with_norm else None
    wk = (1 + 0.1 * torch.randn(D, generator=g, device="cuda")).to(dtype) if with_norm else None
    pos = torch.arange(T, device="cuda", dtype=torch.float32)[:, None] * 11
    inv = 1e6 ** (-torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D)
    ang = torch.cat([pos * inv, pos * inv], dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    slot_mapping = torch.randperm(slots, generator=g, device="cuda")[:T]
    k_cache = torch.randn(slots, hkv, D, generator=g, device="cuda").to(dtype)
    v_cache = torch.randn(slots, hkv, D, generator=g, device="cuda").to(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
    ref_q = norm_rope(q.view(T, hq, D), wq, 1e-6, cos, sin)
    ref_k.index_copy_(0, slot_mapping, norm_rope(k.view(T, hkv, D), wk, 1e-6, cos, sin))
    ref_v.index_copy_(0, slot_mapping, v.reshape(T, hkv, D))
    assert qkv_cache_ok(qkv, D, cos, k_cache)
    got_q = qkv_norm_rope_cache(qkv, wq, wk, 1e-6, cos, sin, hq, hkv, D, k_cache, v_cache,
                                slot_mapping)
    assert torch.equal(got_q, ref_q)  # the same rounding steps as the two-kernel form
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    # the keys kept for a flash prefill step are the ones written to the cache
    k_out = torch.empty(T, hkv, D, dtype=dtype, device="cuda")
    again = qkv_norm_rope_cache(qkv, wq, wk, 1e-6, cos, sin, hq, hkv, D, k_cache, v_cache,
                                slot_mapping, k_out=k_out)
    assert torch.equal(again, ref_q) and torch.equal(k_out, ref_k[slot_mapping])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 8, 16, MAX_ROWS])
def test_swiglu_rows_matches_per_slot_loop(dtype, n):
    g = torch.Generator(device="cuda").manual_seed(n)
    S, H, inter = 6, 512, 192
    w13 = (torch.randn(S, 2 * inter, H, generator=g, device="cuda") / H**0.5).to(dtype)
    w2 = (torch.randn(S, H, inter, generator=g, device="cuda") / inter**0.5).to(dtype)
    rows = torch.randn(n, H, generator=g, device="cuda").to(dtype)
    tags = torch.randint(0, S + 1, (n,), generator=g, device="cuda", dtype=torch.int32)
    tags[0] = S  # the last slot, and (n > 1) a padding row
    if n > 1:
        tags[1] = 0
    assert small_batch_ok(rows, w13)
    got = swiglu_rows(w13, w2, rows, tags)
    ref = grouped_swiglu(w13, w2, rows, tags, use_grouped=False)  # the per-slot loop
    assert bool((got[tags == 0] == 0).all())
    assert _rel(got, ref) < TOL[dtype] * 2
    # the dispatcher takes this path for few rows (and writes into a given buffer)
    buf = torch.empty_like(rows)
    assert torch.equal(grouped_swiglu(w13, w2, rows, tags, out=buf), got)
    # rows and tags as the exchange receives them: strided views of one buffer, read in place
    from elasticep.moe.exchange.padded_exchange import row_width, split_rows

    recv = torch.zeros(n, row_width(H, dtype), dtype=dtype, device="cuda")
    srows, stags = split_rows(recv, H)
    srows.copy_(rows)
    stags.copy_(tags)
    assert srows.stride(0) > H and stags.stride(0) > 1
    assert torch.equal(swiglu_rows(w13, w2, srows, stags), got)


@pytest.mark.parametrize("n", [4, 16, MAX_ROWS])
def test_bounded_tags_read_as_clamped_to_zero_and_the_sources_bound(n):
    # tags as a stopped peer might leave them (beyond S, negative) in blocks of an active
    # and an inactive source: the kernels' bound equals torch.minimum then the plain
    # kernels, and nothing is read out of range
    g = torch.Generator(device="cuda").manual_seed(n)
    S, H, inter, dtype = 4, 256, 128, torch.bfloat16
    w13 = (torch.randn(S, 2 * inter, H, generator=g, device="cuda") / H**0.5).to(dtype)
    w2 = (torch.randn(S, H, inter, generator=g, device="cuda") / inter**0.5).to(dtype)
    rows = torch.randn(n, H, generator=g, device="cuda").to(dtype)
    tags = torch.randint(-3, 3 * S, (n,), generator=g, device="cuda", dtype=torch.int32)
    tags[0], tags[-1] = S, 7 * S  # in range (block 0) and beyond S (block 1, inactive)
    C = n // 2
    bound = torch.tensor([[S], [0]], dtype=torch.int32, device="cuda")  # source 1 inactive
    clamped = torch.minimum(tags.view(2, C), bound).clamp_min(0).view(-1)
    ref = swiglu_rows(w13, w2, rows, clamped)
    got = swiglu_rows(w13, w2, rows, tags, tag_bound=(bound.view(-1), C))
    assert torch.equal(got, ref)
    assert bool((got[C:] == 0).all())  # every row of the inactive source is padding
    # through the dispatcher, which leaves the received tags as they are
    raw = tags.clone()
    assert torch.equal(grouped_swiglu(w13, w2, rows, tags, tag_bound=(bound, C)), ref)
    assert torch.equal(tags, raw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,k,norm", [(128, 8, True), (16, 2, False), (60, 4, True),
                                      (64, 6, False)])
def test_fused_softmax_topk_matches_route(dtype, E, k, norm):
    from elasticep.models.fused_routing import fused_route_ok, fused_softmax_topk

    g = torch.Generator(device="cuda").manual_seed(E + k)
    logits = torch.randn(33, E, generator=g, device="cuda").to(dtype)
    assert fused_route_ok(logits, "softmax", "greedy", k)
    ids, w = fused_softmax_topk(logits, k, norm, 1.5, dtype)
    scores = torch.softmax(logits.float(), -1)
    ref_w, ref_ids = torch.topk(scores, k)
    if norm:
        ref_w = ref_w / (ref_w.sum(-1, keepdim=True) + 1e-20)
    ref_w = (ref_w * 1.5).to(dtype).float()
    # bf16 logits tie often (8 mantissa bits), and torch.topk orders ties its own way:
    # the picks must have the reference's scores, in the same order, k distinct ids
    assert torch.equal(scores.gather(1, ids), scores.gather(1, ref_ids))
    assert all(len(set(row)) == k for row in ids.tolist())
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    assert _rel(w, ref_w) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,H", [(1, 8, 2048), (5, 2, 300), (64, 8, 256), (0, 2, 64)])
@pytest.mark.parametrize("gather", [False, True])
def test_fused_combine_matches_torch_form(dtype, T, k, H, gather):
    from elasticep.moe.exchange.pair_combine import fused_combine, fused_combine_ok

    g = torch.Generator(device="cuda").manual_seed(T * k + H)
    n = 2 * T * k + 3 if gather else T * k
    pair_out = torch.randn(n, H, generator=g, device="cuda").to(dtype)
    weights = torch.rand(T, k, generator=g, device="cuda")
    rows = torch.randperm(n, generator=g, device="cuda")[:T * k] if gather else None
    picked = pair_out[rows] if gather else pair_out
    ref = (picked.view(T, k, H).float() * weights.unsqueeze(-1)).sum(1).to(dtype)
    assert fused_combine_ok(pair_out)
    got = fused_combine(pair_out, weights, dtype, rows)
    assert got.shape == (T, H) and got.dtype == dtype
    if T:
        assert _rel(got, ref) < TOL[dtype]


def _tagged_rows(n: int, S: int, H: int, inter: int, dtype: torch.dtype, max_tag: int,
                 big_slot: tuple[int, int]):
    """Experts ``w13 [S, 2I, H]``, ``w2 [S, H, I]`` and ``n`` strided exchange rows with
    their tags (random in ``[0, max_tag]``; the first ``big_slot[1]`` rows on tag
    ``big_slot[0]``; the last row padding), as the exchange delivers them."""
    from elasticep.moe.exchange.padded_exchange import row_width, split_rows

    g = torch.Generator(device="cuda").manual_seed(n + S)
    w13 = (torch.randn(S, 2 * inter, H, generator=g, device="cuda") / H**0.5).to(dtype)
    w2 = (torch.randn(S, H, inter, generator=g, device="cuda") / inter**0.5).to(dtype)
    recv = torch.zeros(n, row_width(H, dtype), dtype=dtype, device="cuda")
    rows, tags = split_rows(recv, H)
    rows.copy_(torch.randn(n, H, generator=g, device="cuda"))
    tags.copy_(torch.randint(0, max_tag + 1, (n,), generator=g, device="cuda",
                             dtype=torch.int32))
    tags[: big_slot[1]] = big_slot[0]
    if n > 1:
        tags[-1] = 0
    return w13, w2, rows, tags


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,S", [(1, 4), (65, 6), (300, 40), (2048, 128)])
def test_swiglu_sorted_matches_per_slot_loop(dtype, n, S):
    """The sorted-rows kernels against the per-slot loop: padding rows give zeros, a slot
    with more rows than a tile, strided rows read in place, the given buffer written."""
    from elasticep.moe.experts.sorted_experts import sorted_rows_ok, swiglu_sorted

    H = 256
    # slot 0 (tag 1) gets more rows than one BLOCK_M tile
    w13, w2, rows, tags = _tagged_rows(n, S, H, 96, dtype, S, (1, min(n, 40)))
    ref = grouped_swiglu(w13, w2, rows.contiguous(), tags.contiguous(), use_grouped=False)
    assert sorted_rows_ok(rows, w13, w2)
    buf = torch.full((n, H), 3.0, dtype=dtype, device="cuda")
    got = swiglu_sorted(w13, w2, rows, tags, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    assert bool((got[tags == 0] == 0).all())
    assert _rel(got, ref) < TOL[torch.bfloat16] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,S", [(1, 4), (700, 6), (9000, 128), (65536, 128)])
def test_swiglu_tiled_matches_per_slot_loop(dtype, n, S):
    """The tiled grouped GEMM against the per-slot loop at Qwen3-30B-A3B's expert shape:
    padding rows give zeros, one slot far larger than the rest, empty slots, strided
    rows read in place, the given buffer written; grouped_swiglu takes it from
    MIN_ROWS_PER_SLOT rows per slot on."""
    from elasticep.moe.experts.tiled_experts import MIN_ROWS_PER_SLOT, swiglu_tiled, tiled_rows_ok

    H = 2048
    # slots above S/2 stay empty; slot 1 (tag 2) gets a third of the rows
    w13, w2, rows, tags = _tagged_rows(n, S, H, 768, dtype, S // 2, (2, n // 3))
    ref = grouped_swiglu(w13, w2, rows.contiguous(), tags.contiguous(), use_grouped=False)
    buf = torch.full((n, H), 3.0, dtype=dtype, device="cuda")
    got = swiglu_tiled(w13, w2, rows, tags, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    assert bool((got[tags == 0] == 0).all())
    assert _rel(got, ref) < TOL[torch.bfloat16] * 2
    assert tiled_rows_ok(rows, w13, w2) == (n >= MIN_ROWS_PER_SLOT * S)
    via = grouped_swiglu(w13, w2, rows, tags, sync_free=True)
    assert _rel(via, ref) < TOL[torch.bfloat16] * 2


def test_flash_prefill_with_kept_keys_equals_the_unfused_path(tmp_path, monkeypatch):
    """A whole prompt of >= 1024 tokens (the flash path): the model's fused q/k/v kernel
    keeps k and takes v from the projection (no read back from the cache); its logits
    and the keys it cached equal those of the unfused path (norm_rope, then the cache
    writes), to bf16 rounding."""
    import json

    from elasticep.engine.llm_engine import EngineConfig, LLMEngine
    from elasticep.models.fused_norm_rope import DISABLE_ENV

    demo = DEMO_MODEL
    cfg = json.loads((demo / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompt = torch.randint(10, 8000, (1100,), generator=torch.Generator().manual_seed(0)).tolist()
    logits, caches = [], []
    for disabled in ("0", "1"):
        monkeypatch.setenv(DISABLE_ENV, disabled)
        eng = LLMEngine.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda",
                                        load_format="dummy", progress=False,
                                        config=EngineConfig(max_total_tokens=4096,
                                                            max_num_seqs=4,
                                                            enable_cuda_graph=False))
        logits.append(eng.prompt_logits(prompt))
        caches.append(eng.runner.kv_cache.layers[0][0].clone())
    assert _rel(logits[0], logits[1]) < TOL[torch.bfloat16]
    assert _rel(caches[0], caches[1]) < TOL[torch.bfloat16]


def test_equal_prompts_share_one_sdpa_call_and_match_one_call_each():
    """Whole prompts of one length run as one batched SDPA call ([B, H, n, D] views of the
    flat batch, v strided as the fused projection's slice is); each sequence's rows equal
    those of attending that sequence alone (the per-sequence path), to bf16 rounding."""
    from elasticep.models.layers import causal_prefill_attention

    g = torch.Generator(device="cuda").manual_seed(5)
    B, n, hq, hkv, D = 3, 1100, 8, 2, 128
    T = B * n
    q = torch.randn(T, hq, D, generator=g, device="cuda").bfloat16()
    k = torch.randn(T, hkv, D, generator=g, device="cuda").bfloat16()
    v_full = torch.randn(T, (hkv + 3) * D, generator=g, device="cuda").bfloat16()
    v = v_full[:, 3 * D:].view(T, hkv, D)  # strided tokens
    starts = [i * n for i in range(B + 1)]
    got = causal_prefill_attention(q, k, v, starts, D**-0.5)
    assert got.shape == (T, hq * D)
    for i in range(B):
        s, e = starts[i], starts[i + 1]
        one = causal_prefill_attention(q[s:e], k[s:e], v[s:e], [0, n], D**-0.5)
        assert _rel(got[s:e], one) < TOL[torch.bfloat16]
    # and against the CPU reference (GQA by repeated heads)
    ref = causal_prefill_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(),
                                   starts, D**-0.5)
    assert _rel(got.cpu(), ref) < TOL[torch.bfloat16]


def test_tiled_experts_read_each_tokens_row_for_its_top_k_pairs():
    """row_repeat = k: the tiled kernels read token t's row for pairs t*k .. t*k+k-1
    (no [T*k, H] copy), at an 8192-token prefill's 65,536 pairs over 128 slots, against
    the expanded rows through the per-slot loop; a stale output buffer is overwritten
    everywhere, padding pairs with zeros."""
    from elasticep.moe.experts.tiled_experts import swiglu_tiled

    g = torch.Generator(device="cuda").manual_seed(6)
    T, k, S, H, inter = 8192, 8, 128, 2048, 768
    w13 = (torch.randn(S, 2 * inter, H, generator=g, device="cuda") / H**0.5).bfloat16()
    w2 = (torch.randn(S, H, inter, generator=g, device="cuda") / inter**0.5).bfloat16()
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    tags = torch.randint(1, S + 1, (T * k,), generator=g, device="cuda")
    tags[::97] = 0
    ref = grouped_swiglu(w13, w2, x.repeat_interleave(k, 0), tags, use_grouped=False)
    buf = torch.full((T * k, H), 3.0, dtype=torch.bfloat16, device="cuda")
    got = swiglu_tiled(w13, w2, x, tags, out=buf, row_repeat=k)
    assert bool((got[tags == 0] == 0).all())
    assert _rel(got, ref) < TOL[torch.bfloat16] * 2
    assert _rel(grouped_swiglu(w13, w2, x, tags, row_repeat=k), ref) < TOL[torch.bfloat16] * 2
