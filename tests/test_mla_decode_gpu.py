"""MLA's absorbed decode on the GPU (CI has no GPU).

- the Triton kernel (:mod:`elasticep.models.paged_attention.mla_decode`) against the
  torch form of the same attention over the paged latent cache, at DeepSeek-V2/V3's
  latent widths (r 512, dr 64) and a small one, with head counts that do and do not
  fill a head block, and contexts long enough to be split;
- a DeepSeek-V2-Lite-layout checkpoint in bf16 decoding through CUDA graphs: every
  decode step's logits equal the eager forward's (to bf16 noise).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(300)]


def _torch_form(q, cache, tables, lens, page, r, scale):
    """softmax(q . latent) over each sequence's keys, weighted sum of the first r values."""
    out = []
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=q.device)
        lat = cache[tables[b, pos // page].long() * page + pos % page].float()  # [n, r+dr]
        p = torch.softmax((q[b].float() @ lat.T) * scale, dim=-1)  # [Hn, n]
        out.append(p @ lat[:, :r])
    return torch.stack(out)


@pytest.mark.parametrize("r,dr,heads", [(512, 64, 16), (512, 64, 128), (64, 16, 20)])
@pytest.mark.parametrize("lens", [[1], [37, 5, 300], [2100, 17]])
def test_kernel_matches_torch_form(r, dr, heads, lens):
    from elasticep.models.paged_attention.metadata import PagedAttentionMetadata
    from elasticep.models.paged_attention.mla_decode import mla_decode_attention, mla_decode_ok

    g = torch.Generator(device="cuda").manual_seed(r + heads + len(lens))
    page, B = 16, len(lens)
    blocks = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(blocks) + 4, generator=g, device="cuda")  # scattered blocks
    tables, at = [], 0
    for nb in blocks:
        tables.append(perm[at:at + nb].tolist())
        at += nb
    cache = (torch.randn((sum(blocks) + 4) * page, r + dr, generator=g, device="cuda")
             ).to(torch.bfloat16)
    q = torch.randn(B, heads, r + dr, generator=g, device="cuda").to(torch.bfloat16)
    meta = PagedAttentionMetadata.from_lists(tables, lens, [1] * B, page, "cuda")
    scale = (r + dr) ** -0.5 * 0.5
    assert mla_decode_ok(q, cache, r)
    got = mla_decode_attention(q, cache, meta, r, scale)
    t = torch.tensor([tb + [0] * (max(blocks) - len(tb)) for tb in tables], device="cuda")
    ref = _torch_form(q, cache, t, lens, page, r, scale)
    err = float((got.float() - ref).abs().max() / ref.abs().max())
    assert got.shape == (B, heads, r) and err < 2e-2, err


def test_deepseek_decode_graph_logits_equal_eager(tmp_path):
    from _deepseek_ckpt import build
    from _graph_checks import graph_steps_match_eager, random_prompts

    from elasticep.engine.llm_engine import EngineConfig, LLMEngine

    # latent widths the kernel takes (r 64, dr 16), DeepSeek-V2-Lite's layout otherwise
    build("v2_lite", tmp_path, kv_lora_rank=64, qk_rope_head_dim=16)
    eng = LLMEngine.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda", progress=False,
                                    config=EngineConfig(max_total_tokens=2048, max_num_seqs=4,
                                                        enable_cuda_graph=True))
    assert eng.runner.graphs is not None
    steps = graph_steps_match_eager(eng, random_prompts((5, 40, 17)), 16)
    assert steps >= 10 and eng.runner.graphs.replays >= steps


@pytest.mark.parametrize("n", [64, 2048])
def test_expanded_prefill_matches_fp32_masked_form(n):
    """A whole prompt through MLA's expanded form on CUDA in bf16 (SDPA's causal kernel,
    values zero-padded to the query width) against the explicit-mask form in fp32 on the
    CPU, at DeepSeek-V2-Lite's widths (16 heads, dn 128, dr 64, dv 128, r 512)."""
    from elasticep.models.mla import MLAConfig, MLAWeights, _expanded

    cfg = MLAConfig(num_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128)
    g = torch.Generator().manual_seed(n)
    kv_b = torch.randn(16 * (128 + 128), 512, generator=g) / 512**0.5
    w = MLAWeights(kv_a=torch.empty(0), kv_a_norm=torch.empty(0), kv_b=kv_b, o=torch.empty(0))
    q = torch.randn(n, 16, 192, generator=g)
    lat = torch.randn(n, 576, generator=g)
    scale = 192 ** -0.5
    mask = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    kv = torch.nn.functional.linear(lat[:, :512], kv_b).view(n, 16, -1)
    k = torch.cat((kv[..., :128], lat[:, None, 512:].expand(n, 16, 64)), dim=-1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), kv[..., 128:].transpose(0, 1), attn_mask=mask,
        scale=scale).transpose(0, 1).reshape(n, -1)
    wb = MLAWeights(kv_a=w.kv_a, kv_a_norm=w.kv_a_norm, kv_b=kv_b.cuda().bfloat16(), o=w.o)
    got = _expanded(q.cuda().bfloat16(), lat.cuda().bfloat16(), wb, cfg, scale)
    assert got.shape == want.shape
    err = float((got.float().cpu() - want).norm() / want.norm())
    assert err < 1e-2, err


def test_deepseek_prefill_and_mixed_steps_replay_as_token_rows(tmp_path):
    """MLA's prompt tokens through the decode graphs, one row a token (the absorbed
    decode form over the rows' own contexts): 16-token chunks beside decodes fit the
    32-row buckets, and every such step's logits equal the eager forward's (which takes
    MLA's expanded prefill form)."""
    from _deepseek_ckpt import build
    from _graph_checks import graph_steps_match_eager, random_prompts

    from elasticep.engine.llm_engine import EngineConfig, LLMEngine

    build("v2_lite", tmp_path, kv_lora_rank=64, qk_rope_head_dim=16)
    eng = LLMEngine.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda", progress=False,
                                    config=EngineConfig(max_total_tokens=2048, max_num_seqs=4,
                                                        enable_cuda_graph=True,
                                                        chunked_prefill_size=16,
                                                        cuda_graph_max_bs=32))
    steps = graph_steps_match_eager(eng, random_prompts((5, 40, 17)), 8)
    # 62 prompt tokens in chunks of at most 16: at least 4 steps replayed as rows
    assert steps >= 6 and eng.runner.prefill_replays >= 4, eng.runner.prefill_replays
