"""Triton kernels that had only a GPU test, run on CPU under ``TRITON_INTERPRET=1``
against their torch references: add + RMSNorm, q/k norm + RoPE (the per-head and the
head-block kernels), the fused combine (flat and with a row map), the down kernel of
``swiglu_rows`` (padding rows and the tag bound too), and MLA's absorbed decode (split
over the context, then merged).

The wrappers route CPU tensors to the references, so the child process lets them take
CPU tensors (it replaces each wrapper's "CUDA?" predicate), which runs the wrappers'
own launch code. Inputs are float32, so the kernels and the references differ only in
summation order: bounds are a few float32 ulps of the values' scale (about 1e-6
relative), not dtype noise. The fp16 MLA case is bounded by fp16's rounding of its
output (2**-11 relative), as its kernel stores in fp16.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from _interpreted import run_interpreted


def _norm_rope_errors() -> dict[str, float]:
    from elasticep.models import fused_norm_rope as fnr
    from elasticep.models.layers import rms_norm as rms_ref
    from elasticep.models.rope import apply_rope

    fnr.fused_ok = lambda x: True  # let the CPU tensors reach the kernels
    g = torch.Generator().manual_seed(1)
    out = {}
    x, delta = torch.randn(6, 48, generator=g), torch.randn(6, 48, generator=g)
    w = 1 + 0.1 * torch.randn(48, generator=g)
    h, normed = fnr.add_rms_norm(x, delta, w, 1e-6)
    out["add_rms_norm/sum"] = float((h - (x + delta)).abs().max())
    out["add_rms_norm/norm"] = float((normed - rms_ref(x + delta, w, 1e-6)).abs().max())
    out["rms_norm"] = float((fnr.rms_norm(x, w, 1e-6) - rms_ref(x, w, 1e-6)).abs().max())
    heads, D = 11, 16
    wq = 1 + 0.1 * torch.randn(D, generator=g)
    for T in (5, 130):  # per-head kernel below BLOCK_KERNEL_MIN_TOKENS, head blocks above
        wide = torch.randn(T, heads * D + 8, generator=g)
        q = wide[:, :heads * D].reshape(T, heads, D)  # strided tokens, as in a fused qkv
        ang = torch.arange(T, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, D // 2)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        for name, weight in (("norm", wq), ("no_norm", None)):
            ref = apply_rope(q if weight is None else rms_ref(q, weight, 1e-6), cos, sin)
            got = fnr.norm_rope(q, weight, 1e-6, cos, sin)
            out[f"norm_rope/{name}/T{T}"] = float((got - ref).abs().max())
    return out


def _combine_errors() -> dict[str, float]:
    from elasticep.moe.exchange import pair_combine as fc
    from elasticep.moe.exchange.pair_combine import combine_pairs

    g = torch.Generator().manual_seed(2)
    T, k, H = 5, 3, 40  # H below one block: the column mask
    w = torch.rand(T, k, generator=g)
    flat = torch.randn(T * k, H, generator=g)
    rows = torch.randperm(T * k + 4, generator=g)[:T * k]
    scattered = torch.randn(T * k + 4, H, generator=g)
    return {
        "combine/flat": float((fc.fused_combine(flat, w, torch.float32)
                               - combine_pairs(flat, w, torch.float32)).abs().max()),
        "combine/rows": float((fc.fused_combine(scattered, w, torch.float32, rows)
                               - combine_pairs(scattered, w, torch.float32, rows)).abs().max()),
    }


def _swiglu_rows_errors() -> dict[str, float]:
    from elasticep.moe.experts.small_batch_experts import swiglu_rows

    g = torch.Generator().manual_seed(3)
    S, inter, H, N = 3, 24, 40, 6
    w13 = torch.randn(S, 2 * inter, H, generator=g) / H ** 0.5
    w2 = torch.randn(S, H, inter, generator=g) / inter ** 0.5
    rows = torch.randn(N, H, generator=g)
    tags = torch.tensor([1, 3, 0, 2, 9, 1], dtype=torch.int64)  # 0: padding; 9: past S
    bound = torch.tensor([S, 0], dtype=torch.int32)  # rows 0-2: slots; 3-5: an inactive source
    got = swiglu_rows(w13, w2, rows, tags, tag_bound=(bound, 3))
    ref = torch.zeros(N, H)
    for n, tag in enumerate(tags.tolist()[:3]):
        if tag:
            gate, up = F.linear(rows[n:n + 1], w13[tag - 1]).chunk(2, dim=-1)
            ref[n] = F.linear(F.silu(gate) * up, w2[tag - 1])[0]
    unbounded = swiglu_rows(w13, w2, rows[:4], tags[:4])
    gate, up = F.linear(rows[3:4], w13[1]).chunk(2, dim=-1)
    return {"swiglu_rows/bounded": float((got - ref).abs().max()),
            "swiglu_rows/unbounded_row3": float(
                (unbounded[3] - F.linear(F.silu(gate) * up, w2[1])[0]).abs().max())}


def _mla_decode_errors() -> dict[str, float]:
    from elasticep.models.paged_attention import mla_decode
    from elasticep.models.paged_attention.metadata import PagedAttentionMetadata

    mla_decode.mla_decode_ok = lambda q, cache, r: True  # CPU tensors reach the kernel
    g = torch.Generator().manual_seed(4)
    r, dr, heads, page = 64, 16, 20, 16  # 20 heads: the second head block is masked
    lens = [520, 37]  # 520 keys: two splits of the context, then the merge
    blocks = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(blocks) + 2, generator=g)
    tables = [perm[:blocks[0]].tolist(), perm[blocks[0]:sum(blocks)].tolist()]
    cache = torch.randn((sum(blocks) + 2) * page, r + dr, generator=g).half()
    q = torch.randn(len(lens), heads, r + dr, generator=g).half()
    meta = PagedAttentionMetadata.from_lists(tables, lens, [1, 1], page, "cpu")
    scale = (r + dr) ** -0.5
    got = mla_decode.mla_decode_attention(q, cache, meta, r, scale).float()
    ref = []
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        table = torch.tensor(tables[b])
        lat = cache[table[pos // page] * page + pos % page].float()
        ref.append(torch.softmax(q[b].float() @ lat.T * scale, -1) @ lat[:, :r])
    ref = torch.stack(ref)
    return {"mla_decode/rel": float((got - ref).abs().max() / ref.abs().max())}


def _interpreted_errors() -> dict[str, float]:
    return {**_norm_rope_errors(), **_combine_errors(), **_swiglu_rows_errors(),
            **_mla_decode_errors()}


def test_kernels_match_their_references_under_the_interpreter():
    errs = run_interpreted(__file__, timeout_s=100)
    assert set(errs) == {
        "add_rms_norm/sum", "add_rms_norm/norm", "rms_norm",
        *(f"norm_rope/{n}/T{T}" for n in ("norm", "no_norm") for T in (5, 130)),
        "combine/flat", "combine/rows", "swiglu_rows/bounded", "swiglu_rows/unbounded_row3",
        "mla_decode/rel"}
    for name, err in errs.items():
        # float32 kernels: summation order only; the residual add is bit-exact
        bound = {"add_rms_norm/sum": 0.0, "mla_decode/rel": 2.0 ** -10}.get(name, 1e-5)
        assert err <= bound, f"{name}: max error {err} (bound {bound})"


if __name__ == "__main__":
    print(json.dumps(_interpreted_errors()))
