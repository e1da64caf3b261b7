"""The tiled grouped-GEMM experts (prefill sizes) on CPU: the block layout, and the
Triton kernels under ``TRITON_INTERPRET=1`` (in a child process: the flag must be set
before triton is imported) against the per-slot matmul loop, with the sorted-rows
kernels (mid sizes), which share their SwiGLU epilogue. The GPU test at real sizes is in
test_fused_kernels_gpu.py."""

from __future__ import annotations

import json

import torch
from _interpreted import run_interpreted

from elasticep.moe.experts.sorted_experts import slot_order
from elasticep.moe.experts.tiled_experts import block_layout


def test_slot_order_is_the_stable_order_of_the_pairs_slots():
    """The int16 sort key gives the int64 key's stable order (pairs of a slot keep their
    order, padding last), with each slot's start and count; wide slot counts keep int64."""
    gen = torch.Generator().manual_seed(3)
    for slots, n in ((16, 1), (128, 512), (300, 4096), (2**15, 777)):
        tags = torch.randint(0, slots + 1, (n,), generator=gen)  # 0: padding
        order, starts, counts = slot_order(tags, slots)
        key = torch.where(tags > 0, tags - 1, slots)
        assert torch.equal(order, torch.sort(key, stable=True).indices)
        assert torch.equal(counts, torch.bincount(key, minlength=slots + 1))
        assert torch.equal(starts, torch.cumsum(counts, 0) - counts)
        assert torch.equal(key[order], torch.sort(key).values)


def test_block_layout_maps_every_row_block_to_its_slot():
    counts = torch.tensor([0, 5, 16, 17, 0, 1])
    slot, first, grid = block_layout(counts, n_rows=int(counts.sum()) + 3, block_m=8)
    # blocks per slot 0,1,2,3,0,1 -> 7 real blocks; grid = ceil(42/8) + 6 = 12
    assert grid == 12
    assert first.tolist() == [0, 0, 1, 3, 6, 6]
    assert slot.tolist() == [1, 2, 2, 3, 3, 3, 5, 6, 6, 6, 6, 6]


def _interpreted_errors() -> dict[str, float]:
    """Relative error of swiglu_tiled and swiglu_sorted against the per-slot loop, per
    kernel and case (fp32)."""
    from elasticep.moe.experts.expert_compute import grouped_swiglu
    from elasticep.moe.experts.sorted_experts import swiglu_sorted
    from elasticep.moe.experts.tiled_experts import swiglu_tiled

    errs = {}
    for name, (S, N, big) in {"one_big_slot": (5, 300, 100), "empty_slots": (9, 90, 0),
                              "single_row": (3, 1, 0)}.items():
        g = torch.Generator().manual_seed(N + S)
        H, inter = 64, 48
        w13 = torch.randn(S, 2 * inter, H, generator=g) / H**0.5
        w2 = torch.randn(S, H, inter, generator=g) / inter**0.5
        full = torch.randn(N, H + 8, generator=g)
        rows = full[:, :H]  # strided, as the exchange's tagged rows
        tags = torch.randint(0, S // 2 + 1, (N,), generator=g, dtype=torch.int32)
        tags[:big] = 2
        if N > 1:
            tags[-1] = 0
        ref = grouped_swiglu(w13, w2, rows.contiguous(), tags, use_grouped=False)
        # a stale buffer: padding rows must come back zero from the down kernel itself
        got = swiglu_tiled(w13, w2, rows, tags, out=torch.full((N, H), 3.0),
                           gate_up_tile=(16, 32, 32, 4, 2), down_tile=(16, 32, 32, 4, 2))
        srt = swiglu_sorted(w13, w2, rows, tags, gate_up_tile=(16, 32, 32, 4),
                            down_tile=(16, 32, 32, 4))
        for kernel, out in (("tiled", got), ("sorted", srt)):
            assert bool((out[tags == 0] == 0).all()), (kernel, name)
            errs[f"{kernel}/{name}"] = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
        if N % 2 == 0:  # two pairs per token, read from the token's row (no expanded copy)
            tok = rows[::2]
            rep = swiglu_tiled(w13, w2, tok, tags, gate_up_tile=(16, 32, 32, 4, 2),
                               down_tile=(16, 32, 32, 4, 2), row_repeat=2)
            ref2 = grouped_swiglu(w13, w2, tok.repeat_interleave(2, 0).contiguous(), tags,
                                  use_grouped=False)
            assert bool((rep[tags == 0] == 0).all()), name
            errs[f"tiled_repeat/{name}"] = float((rep - ref2).norm()
                                                 / ref2.norm().clamp_min(1e-30))
    return errs


def test_tiled_and_sorted_kernels_interpreted_match_per_slot_loop():
    errs = run_interpreted(__file__, timeout_s=150)
    assert set(errs) == {f"{k}/{c}" for k in ("tiled", "sorted")
                         for c in ("one_big_slot", "empty_slots", "single_row")} | {
        "tiled_repeat/one_big_slot", "tiled_repeat/empty_slots"}
    for name, err in errs.items():
        assert err < 1e-5, f"{name}: relative error {err}"


if __name__ == "__main__":
    print(json.dumps(_interpreted_errors()))
