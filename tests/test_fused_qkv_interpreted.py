"""The fused q/k/v kernel (q/k norm, RoPE, KV-cache writes) under ``TRITON_INTERPRET=1``
on CPU, with and without ``k_out`` (the keys kept for a flash prefill step): q and the
kept keys against the torch forms, the kept keys equal to what went into the cache, and
the cache slots not written untouched. The GPU test is in test_fused_kernels_gpu.py."""

from __future__ import annotations

import json

import torch
from _interpreted import run_interpreted


def _interpreted_errors() -> dict[str, float]:
    out = {}
    # 5 tokens: a program a head; 130: 8 heads a program (15 heads: the second masked)
    for T, slots in ((5, 12), (130, 160)):
        out.update({f"{k}/T{T}": v for k, v in _errors_at(T, slots).items()})
    return out


def _errors_at(T: int, slots: int) -> dict[str, float]:
    from elasticep.models.fused_norm_rope import norm_rope, qkv_norm_rope_cache

    g = torch.Generator().manual_seed(4)
    hq, hkv, D = 9, 3, 16
    qkv_full = torch.randn(T, (hq + 2 * hkv) * D + 8, generator=g)
    qkv = qkv_full[:, :(hq + 2 * hkv) * D]  # strided tokens
    wq, wk = 1 + 0.1 * torch.randn(D, generator=g), 1 + 0.1 * torch.randn(D, generator=g)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, D // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    slot_mapping = torch.randperm(slots, generator=g)[:T]
    q_ref = norm_rope(qkv[:, :hq * D].reshape(T, hq, D), wq, 1e-6, cos, sin)
    k_ref = norm_rope(qkv[:, hq * D:(hq + hkv) * D].reshape(T, hkv, D), wk, 1e-6, cos, sin)
    v_ref = qkv[:, (hq + hkv) * D:].reshape(T, hkv, D)
    out = {}
    for keep in (False, True):
        k_cache, v_cache = torch.randn(slots, hkv, D, generator=g), torch.randn(slots, hkv, D)
        before = k_cache.clone()
        k_out = torch.empty(T, hkv, D) if keep else None
        q = qkv_norm_rope_cache(qkv, wq, wk, 1e-6, cos, sin, hq, hkv, D, k_cache, v_cache,
                                slot_mapping, k_out=k_out)
        untouched = [s for s in range(slots) if s not in slot_mapping.tolist()]
        assert torch.equal(k_cache[untouched], before[untouched])
        assert torch.equal(v_cache[slot_mapping], v_ref)
        out[f"q/{keep}"] = float((q - q_ref).abs().max())
        out[f"k_cache/{keep}"] = float((k_cache[slot_mapping] - k_ref).abs().max())
        if keep:
            assert torch.equal(k_out, k_cache[slot_mapping])
            out["k_out"] = float((k_out - k_ref).abs().max())
    return out


def test_qkv_kernel_interpreted_keeps_k_when_asked():
    errs = run_interpreted(__file__, timeout_s=90)
    assert set(errs) == {f"{k}/T{T}" for k in ("q/False", "q/True", "k_cache/False",
                                                "k_cache/True", "k_out") for T in (5, 130)}
    for name, err in errs.items():
        assert err < 1e-5, f"{name}: max error {err}"


if __name__ == "__main__":
    print(json.dumps(_interpreted_errors()))
