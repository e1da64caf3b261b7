"""DeepSeek-V2/V3 (MLA, grouped routing, shared experts, YaRN) vs transformers' own classes.

Three tiny seeded checkpoints (tests/_deepseek_ckpt.py): V2-Lite's layout (plain q_proj,
softmax, greedy), V2 (query LoRA, group_limited_greedy) and V3 (sigmoid, noaux_tc with
a correction bias, renormalised top-k), each with a dense first layer and YaRN.
"""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
import torch
from _deepseek_ckpt import VARIANTS, build
from _model_helpers import rel_err, run_batched

from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.model_runner import ModelRunner
from elasticep.engine.request import SamplingParams
from elasticep.models import load_model, load_model_config
from elasticep.models.layers import AttentionMetadata
from elasticep.models.mla import mla_attention, padded_prefill_ok
from elasticep.models.paged_attention import PagedAttentionMetadata
from elasticep.models.rope import rope_cos_sin
from elasticep.models.routing import RoutingConfig, route
from elasticep_testkit.torch_threads import one_torch_thread

pytestmark = pytest.mark.timeout(300)

PROMPT_LENS = (5, 11, 17, 40)
NEAR_TIE = 1e-3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """variant -> (variant, path, prompts, transformers' logits per prompt, HF model), built once."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            path = tmp_path_factory.mktemp(variant)
            ref = build(variant, path, seed=list(VARIANTS).index(variant))
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(1, 8192, (n,), generator=gen).tolist() for n in PROMPT_LENS]
            with torch.no_grad():
                ref_logits = [ref(torch.tensor([p])).logits[0].float() for p in prompts]
            cache[variant] = variant, path, prompts, ref_logits, ref
        return cache[variant]

    return get


@pytest.fixture(params=list(VARIANTS))
def checkpoint(request, built):
    return built(request.param)


def test_logits_match_transformers(checkpoint):
    variant, path, prompts, ref_logits, _ = checkpoint
    model = load_model(path, progress=False)
    cfg = model.config
    assert (cfg.model_type, cfg.rope.rope_type, cfg.moe_layers) == (VARIANTS[variant][0], "yarn",
                                                                     (False, True, True))
    assert (cfg.mla.q_lora_rank is None) == (variant == "v2_lite")
    for split in (3, 1):  # a chunked prefill over the cache, then a decode step
        for ours, ref in zip(run_batched(model, prompts, split), ref_logits, strict=True):
            assert rel_err(ours, ref) <= 1e-4, f"{variant} split {split}: rel err {rel_err(ours, ref):.2e}"


def test_absorbed_decode_equals_expanded(checkpoint):
    variant, path, *_ = checkpoint
    model = load_model(path, progress=False)
    c = model.config
    m = c.mla
    g = torch.Generator().manual_seed(3)
    ctx_lens, bs = [7, 1, 30, 12], 4
    need = [-(-n // bs) for n in ctx_lens]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()  # scattered blocks, like a paged cache
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(ctx_lens))]
    num_slots = len(perm) * bs
    last = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, ctx_lens, strict=True)]
    meta = AttentionMetadata(list(range(len(ctx_lens) + 1)), ctx_lens, torch.tensor(last),
                             PagedAttentionMetadata.from_lists(tables, ctx_lens, [1] * len(ctx_lens), bs))
    cache = torch.randn(num_slots, m.cache_width, generator=g)
    x = torch.randn(len(ctx_lens), c.hidden_size, generator=g)
    cos, sin = rope_cos_sin(c.rope, torch.tensor(ctx_lens) - 1, c.rope_dim, torch.float32)
    scale = m.qk_head_dim**-0.5 * c.rope.softmax_mscale
    w = model.layers[1].attn
    outs = [mla_attention(x, w, m, cos, sin, cache.clone(), meta, scale, c.rms_norm_eps, absorb=a)
            for a in (True, False)]
    assert rel_err(outs[0], outs[1]) <= 1e-5
    with pytest.raises(ValueError, match="absorbed MLA form needs a decode step"):
        prefill = AttentionMetadata([0, 4], [4], torch.arange(4),
                                    PagedAttentionMetadata.from_lists([[0]], [4], [4], bs))
        mla_attention(x, w, m, cos, sin, cache.clone(), prefill, scale, c.rms_norm_eps, absorb=True)


def test_padded_prefill_rule():
    assert not padded_prefill_ok([128])  # one prompt: nothing to batch
    assert padded_prefill_ok([128] * 16) and padded_prefill_ok([512] * 4)
    assert not padded_prefill_ok([2048] * 4)  # long prompts: one call each
    assert not padded_prefill_ok([1000, 10, 10])  # mostly padding
    assert padded_prefill_ok([300, 200, 100])  # 900 cells for 600 tokens


def test_padded_prefill_equals_per_sequence(checkpoint):
    """The whole-prompt MLA prefill as one padded SDPA call against one call per
    sequence (fp32, no cache and over a cache): bitwise equal for prompts of one length;
    for ragged ones SDPA's key tiles differ (padded keys), which moves the last bit."""
    variant, path, *_ = checkpoint
    model = load_model(path, progress=False)
    c, m = model.config, model.config.mla
    w = model.layers[1].attn
    scale = m.qk_head_dim**-0.5 * c.rope.softmax_mscale
    g = torch.Generator().manual_seed(5)
    for lens in ([16] * 6, [5, 11, 17, 40], [1, 30], [3]):
        T = sum(lens)
        starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
        x = torch.randn(T, c.hidden_size, generator=g)
        cos, sin = rope_cos_sin(c.rope, torch.cat([torch.arange(n) for n in lens]), c.rope_dim,
                                torch.float32)
        for cached in (False, True):
            slots = torch.randperm(T + 8, generator=g)[:T]
            meta = AttentionMetadata(starts, list(lens), slots)
            cache = torch.zeros(T + 8, m.cache_width) if cached else None
            if cached:
                tables = [slots[a:b].tolist() for a, b in pairwise(starts)]
                meta.paged = PagedAttentionMetadata.from_lists(tables, lens, lens, 1)
            per_seq, padded = (mla_attention(x, w, m, cos, sin, cache, meta, scale,
                                             c.rms_norm_eps, padded=p) for p in (False, True))
            if len(set(lens)) == 1:
                assert torch.equal(per_seq, padded), (variant, lens, cached)
            else:
                torch.testing.assert_close(padded, per_seq, rtol=1e-6, atol=1e-6)
    chunk = AttentionMetadata([0, 2], [4], torch.arange(2),
                              PagedAttentionMetadata.from_lists([[0]], [4], [2], 4))
    with pytest.raises(ValueError, match="padded MLA prefill needs a step of whole prompts"):
        mla_attention(x[:2], w, m, cos[:2], sin[:2], torch.zeros(4, m.cache_width), chunk,
                      scale, c.rms_norm_eps, padded=True)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_routing_of_an_empty_batch(method):
    # an idle EP rank still runs every MoE layer with T = 0 tokens
    cfg = RoutingConfig(8, 3, scoring_func="sigmoid", topk_method=method, n_group=4, topk_group=2)
    ids, weights = route(torch.zeros(0, 16), torch.randn(8, 16), cfg, torch.randn(8))
    assert ids.shape == weights.shape == (0, 3)


def test_kv_cache_holds_the_latent_only(checkpoint):
    variant, path, *_ = checkpoint
    model = load_model(path, progress=False)
    c, m = model.config, model.config.mla
    runner = ModelRunner(model, num_blocks=8, block_size=4)
    # 8 blocks of 4 slots, plus the one block the decode CUDA graphs pad into (the sink)
    assert all(len(layer) == 1 and layer[0].shape == (36, m.kv_lora_rank + m.qk_rope_head_dim)
               for layer in runner.kv_cache.layers)
    assert runner.kv_cache.bytes_per_token == c.num_hidden_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    full = c.num_hidden_layers * m.full_kv_width() * 4  # per-head K and V, as MHA would cache
    assert full / runner.kv_cache.bytes_per_token == pytest.approx(4 * (24 + 16) / 40)


def test_greedy_32_tokens_equal_transformers_generate(built):
    variant, path, prompts, _, ref = built("v3")
    engine = LLMEngine.from_pretrained(path, progress=False)
    ours = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
        want = out.sequences[0, len(prompt):].tolist()
        if got == want:
            continue
        j = next(k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        top2 = torch.topk(out.logits[j][0].float(), 2).values
        assert float(top2[0] - top2[1]) < NEAR_TIE, f"{variant} token {j} differs: {got} vs {want}"


def test_dummy_load_format_and_config_errors(checkpoint, tmp_path):
    variant, path, prompts, *_ = checkpoint
    only = tmp_path / "config-only"
    only.mkdir()
    (only / "config.json").write_text((path / "config.json").read_text())
    model = load_model(only, load_format="dummy", progress=False)
    logits = run_batched(model, prompts[:2], split=1)
    assert all(torch.isfinite(x).all() for x in logits)
    if variant == "v3":
        bias = model.layers[1].moe.router_bias
        assert bias is not None and bias.dtype == torch.float32 and bias.abs().sum() > 0

    raw = json.loads((path / "config.json").read_text())
    for i, (change, message) in enumerate((
            ({"topk_method": "random"}, "topk_method 'random' is not supported"),
            ({"topk_method": "group_limited_greedy", "n_group": 3}, "n_group 3 must divide n_routed_experts 8"),
            ({"scoring_func": "tanh"}, "scoring_func 'tanh' is not supported"))):
        bad = tmp_path / str(i)
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(ValueError, match=message) as err:
            load_model_config(bad)
        assert "\n" not in str(err.value)
