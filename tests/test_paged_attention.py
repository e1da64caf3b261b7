"""Paged attention: the torch reference against a dense oracle, Triton against the reference.

The Triton kernels run on CPU under ``TRITON_INTERPRET=1`` in a child process (the flag
must be set before the kernels are defined, and must not leak into other tests).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from _interpreted import run_interpreted
from _paged_cases import dense_oracle, make_case

from elasticep.models.paged_attention import (
    AttentionBackend,
    PagedAttentionMetadata,
    paged_attention,
    paged_attention_reference,
    paged_attention_sdpa,
)

pytestmark = pytest.mark.timeout(60)

# (seq lens, query lens, Hq, Hkv): decode, prefill, mixed, MHA, GQA 2/4/8
CASES = [
    ([37, 1, 16, 130, 64], [1, 1, 1, 1, 1], 8, 2),
    ([20, 45, 17], [20, 45, 17], 4, 4),
    ([50, 9, 200, 33], [1, 9, 7, 33], 8, 1),
    ([300, 17, 81], [1, 5, 1], 16, 2),
    ([3], [2], 2, 1),
]


TORCH_IMPLS = [paged_attention_reference, paged_attention_sdpa]


@pytest.mark.parametrize("impl", TORCH_IMPLS)
@pytest.mark.parametrize("lens,qlens,hq,hkv", CASES)
def test_torch_impls_match_dense(lens, qlens, hq, hkv, impl):
    c = make_case(lens, qlens, hq, hkv, d=16, seed=len(lens))
    got = impl(*c.args())
    assert got.shape == c.q.shape and got.dtype == c.q.dtype
    torch.testing.assert_close(got, dense_oracle(c), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", TORCH_IMPLS)
def test_torch_impls_bf16_and_loose_bounds(impl):
    """bf16 in/out, and host bounds larger than needed (an upper bound is allowed)."""
    c = make_case([40, 7, 90], [3, 7, 1], 8, 2, d=32, dtype=torch.bfloat16)
    loose = replace(c.meta, max_query_len=c.meta.max_query_len + 5,
                    max_seq_len=c.meta.max_seq_len + 10)  # still within the block table
    got = impl(c.q, c.k_cache, c.v_cache, loose, c.scale)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), dense_oracle(c), rtol=2e-2, atol=2e-2)


def test_dense_layout_is_built_once_per_step():
    """Every layer of a step reuses one set of index tensors (keyed by T and cache size)."""
    c = make_case([33, 5, 70], [2, 5, 1], 4, 2, d=8)
    T, slots = c.q.shape[0], c.k_cache.shape[0]
    lay = c.meta.dense_layout(T, slots)
    assert c.meta.dense_layout(T, slots) is lay
    assert lay.token_cells.tolist() == [0, 1, 5, 6, 7, 8, 9, 10]  # Mq = 5: rows 0, 1, 2
    assert lay.visible.shape == (3, 5, 70) and int(lay.visible[1, 4].sum()) == 5


def test_dispatch_cpu_is_sdpa_and_rejects_bad_input():
    c = make_case([10, 20], [1, 1], 4, 2, d=8)
    assert torch.equal(paged_attention(*c.args()), paged_attention_sdpa(*c.args()))
    assert torch.equal(paged_attention(*c.args(), backend="reference"),
                       paged_attention_reference(*c.args()))
    with pytest.raises(ValueError, match="unknown attention backend"):
        paged_attention(*c.args(), backend="cudnn")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(c.q[:, :3], *c.args()[1:])
    with pytest.raises(ValueError, match="exceeds the block table"):
        paged_attention(c.q, c.k_cache, c.v_cache, replace(c.meta, max_seq_len=10_000), c.scale)
    assert AttentionBackend.parse("flex") is AttentionBackend.FLEX


def test_metadata_from_lists_matches_hand_built():
    c = make_case([33, 5, 70], [2, 5, 1], 4, 2, d=8)
    meta = PagedAttentionMetadata.from_lists(c.tables, c.lens, c.qlens, 16)
    assert meta.query_start_loc.tolist() == c.meta.query_start_loc.tolist()
    assert meta.seq_lens.tolist() == c.lens and meta.max_seq_len == 70 and meta.max_query_len == 5
    torch.testing.assert_close(paged_attention(c.q, c.k_cache, c.v_cache, meta, c.scale),
                               dense_oracle(c), rtol=1e-5, atol=1e-5)
    assert meta.token_sequence_ids(8).tolist() == [0, 0, 1, 1, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="do not fit"):
        PagedAttentionMetadata.from_lists([[1]], [17], [1], 16)


@pytest.mark.parametrize("batch", [1, 3, 4, 7, 16])
@pytest.mark.parametrize("longest", [1, 5, 16, 17, 33])
def test_metadata_from_lists_keeps_kernel_specializations_alike(batch, longest):
    """Whatever the composition, the tables' row stride is divisible by 16 and every
    tensor starts 16-byte aligned, so a Triton kernel is never compiled again for a new
    batch shape (Triton specializes on both)."""
    tables = [list(range(longest if i == 0 else 1)) for i in range(batch)]
    meta = PagedAttentionMetadata.from_lists(tables, [16] * batch, [1] * batch, 16)
    assert meta.block_tables.stride(0) % 16 == 0 and meta.block_tables.shape[1] >= longest
    for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc):
        assert t.storage_offset() * t.element_size() % 16 == 0
    assert meta.block_tables[0, :longest].tolist() == tables[0]
    assert meta.seq_lens.tolist() == [16] * batch
    assert meta.query_start_loc.tolist() == list(range(batch + 1))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_eager_matches_dense():
    """The block mask and the slot -> (owner, position) map, through eager flex on CPU.

    Decode goes through the padded static-batch path (empty sequences appended).
    """
    for (lens, qlens, hq, hkv) in (CASES[0], CASES[2]):
        c = make_case(lens, qlens, hq, hkv, d=16, seed=3, spare_blocks=1)
        got = paged_attention(*c.args(), backend="flex")
        torch.testing.assert_close(got, dense_oracle(c), rtol=1e-5, atol=1e-5)


def _interpreted_errors() -> dict[str, float]:
    """Max |triton - reference| per case; runs in the child with TRITON_INTERPRET=1."""
    from elasticep.models.paged_attention.triton_kernels import (
        TritonAttentionConfig,
        paged_attention_triton,
    )

    decode_gqa8 = (CASES[3][0], [1, 1, 1], 16, 2)
    runs = {
        "decode_gqa4_split": (CASES[0], TritonAttentionConfig(block_n=16, num_splits=3)),
        "decode_gqa8_auto": (decode_gqa8, TritonAttentionConfig(block_n=16, min_split_tokens=64)),
        "prefill_mha": (CASES[1], TritonAttentionConfig(block_n=16)),
        "mixed_gqa8": (CASES[2], TritonAttentionConfig(block_n=32)),
        "mixed_split": (CASES[2], TritonAttentionConfig(block_n=16, num_splits=4)),
    }
    errs = {}
    for name, ((lens, qlens, hq, hkv), cfg) in runs.items():
        c = make_case(lens, qlens, hq, hkv, d=16, seed=7)
        got = paged_attention_triton(*c.args(), config=cfg)
        errs[name] = float((got - paged_attention_reference(*c.args())).abs().max())
    return errs


def test_triton_interpreted_matches_reference():
    errs = run_interpreted(__file__, timeout_s=50)
    assert len(errs) == 5
    for name, err in errs.items():
        assert err < 1e-4, f"{name}: max abs error {err}"


if __name__ == "__main__":
    print(json.dumps(_interpreted_errors()))
