"""The FP8 experts' prefill on FP8 tensor cores (:mod:`elasticep.moe.experts.fp8_tiled`)
on the CPU.

The W8A8 torch reference against hand-computed blocks and against the FP8 experts that
keep bf16 activations (within the activations' e4m3 rounding, bound derived in
elasticep_testkit/fp8_w8a8_bounds.py); the Triton kernels under ``TRITON_INTERPRET=1`` against
the reference, stage by stage; and the rule that sends a batch to them. The GPU test
(tests/test_fp8_expert_prefill_gpu.py) runs the compiled kernels at real shapes.
"""

from __future__ import annotations

import json

import pytest
import torch
from _interpreted import run_interpreted

from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_activations import (
    dequantize_activations,
    quantize_activations_reference,
)
from elasticep.moe.experts.fp8_rows import swiglu_rows_fp8_reference
from elasticep.moe.experts.fp8_tiled import (
    MIN_CAPABILITY,
    swiglu_w8a8_reference,
    w8a8_down_reference,
    w8a8_experts_ok,
    w8a8_intermediate_reference,
)
from elasticep.moe.experts.tiled_experts import MIN_ROWS_PER_SLOT
from elasticep_testkit.fp8_w8a8_bounds import down_bound, expert_bounds, unsort, worst

pytestmark = pytest.mark.timeout(200)
F8 = fp8_block.FP8_DTYPE


def _hand_experts():
    """Two slots of H 256, I 128 whose every weight is 1 (slot 1) or 0.5 (slot 2), block
    scales 0.5 / 0.25 (gate), 1 / 2 (up) and 2^-10 / 2^-12 (down's two row blocks)."""
    q13 = torch.ones(2, 256, 256)
    q13[1] = 0.5
    s13 = torch.tensor([[0.5, 0.25], [1.0, 2.0]]).expand(2, 2, 2).contiguous()
    q2 = torch.ones(2, 256, 128).to(F8)
    s2 = torch.tensor([[2.0 ** -10], [2.0 ** -12]]).expand(2, 2, 1).contiguous()
    return q13.to(F8), s13, q2, s2


def test_reference_on_hand_computed_blocks():
    w13, s13, w2, s2 = _hand_experts()
    # each token: 128 columns of 1.75 (amax 448 * 2^-8: scale 2^-8, all e4m3 448) and 128
    # of 0.4375 (scale 2^-10): both quantize exactly
    rows = torch.cat([torch.full((3, 128), 1.75), torch.full((3, 128), 0.4375)], 1).bfloat16()
    tags = torch.tensor([1, 2, 0])
    act = w8a8_intermediate_reference(w13, s13, rows, tags)
    # slot 1: gate = 128 (1.75 * 0.5 + 0.4375 * 0.25) = 126, up = 128 (1.75 + 0.875) =
    # 336; SiLU(126) = 126 in bf16; 126 * 336 = 42336 rounds to 42240 (bf16 steps of 256
    # there). Slot 2 (weights halved): 63 * 168 = 10584 rounds to 10560 (steps of 64).
    assert act[0].float().tolist() == [42240.0] * 128
    assert act[1].float().tolist() == [10560.0] * 128
    assert not act[2].float().any()
    out = swiglu_w8a8_reference(w13, s13, w2, s2, rows, tags)
    # the intermediate's group quantizes to 448 x (a / 448), one float32 rounding off a;
    # down: 128 a 2^-10 (rows 0-127) and 128 a 2^-12 (rows 128-255), exact in bf16
    assert out[0].float().tolist() == [5280.0] * 128 + [1320.0] * 128
    assert out[1].float().tolist() == [1320.0] * 128 + [330.0] * 128
    assert not out[2].float().any()


def test_reference_takes_each_group_scale():
    # one token whose groups differ by 2^12 in scale: a reference that ignored the
    # activation scales (or read them per token) would be off by that factor
    w13, s13, w2, s2 = _hand_experts()
    rows = torch.cat([torch.full((1, 128), 448.0), torch.full((1, 128), 448.0 * 2.0 ** -12)],
                     1).bfloat16()
    act = w8a8_intermediate_reference(w13, s13, rows, torch.tensor([1]))
    gate, up = 128 * (448 * 0.5 + 448 * 2.0 ** -12 * 0.25), 128 * (448 + 448 * 2.0 ** -11)
    want = torch.tensor(gate).bfloat16().float() * torch.tensor(up).bfloat16().float()
    assert act[0, 0].float() == want.bfloat16().float()
    q, s = quantize_activations_reference(act)
    y = w8a8_down_reference(q, s, w2, s2, torch.tensor([1]), torch.bfloat16)
    assert float(y[0, 0]) == pytest.approx(128 * float(want) * 2.0 ** -10, rel=2.0 ** -7)


def make_case(slots: int, hidden: int, inter: int, tokens: int, row_repeat: int,
              dtype: torch.dtype, seed: int):
    """FP8 experts (block scales spanning three decades over the input columns), token
    rows spanning two, and ``tokens * row_repeat`` tags: uneven slot counts, slot 2 empty,
    a padding pair first."""
    gen = torch.Generator().manual_seed(seed)
    cols = torch.logspace(-3, 0, hidden)
    w13, s13 = fp8_block.quantize(torch.randn(slots, 2 * inter, hidden, generator=gen) * cols)
    w2, s2 = fp8_block.quantize(torch.randn(slots, hidden, inter, generator=gen) * 0.05)
    rows = (torch.randn(tokens, hidden, generator=gen) * torch.logspace(0, -2, hidden)).to(dtype)
    weights = torch.tensor([0.0, 1.0, 0.0, 4.0, 1.0, 0.5][: slots + 1])  # tag 0: padding
    tags = torch.multinomial(weights, tokens * row_repeat, replacement=True, generator=gen)
    tags[0] = 0
    return w13, s13, w2, s2, rows, tags


def test_reference_against_the_fp8_experts_within_the_activation_rounding():
    case = make_case(5, 384, 256, 24, 2, torch.bfloat16, seed=0)
    w13, s13, w2, s2, rows, tags = case
    got = swiglu_w8a8_reference(*case, row_repeat=2).float()
    exact = swiglu_rows_fp8_reference(w13, s13, w2, s2, rows.repeat_interleave(2, 0),
                                      tags).float()
    live = tags > 0
    # the bound: the rows and the intermediate each rounded to e4m3 (2^-4 relative, or
    # 2^-10 of the group scale if subnormal) on one side only, carried through the
    # SwiGLU and the down projection (elasticep_testkit/fp8_w8a8_bounds.py)
    bound = expert_bounds(*case, 2, x_rounded=True, acc=0.0, sides=1)["out"]
    assert worst(got - exact, bound, live) <= 1
    assert not got[~live].any()
    # and the activations were quantized: a few percent off in norm, not zero
    rel = float((got - exact).norm() / exact.norm())
    assert 0.003 < rel < 0.06, rel


def _interpreted_errors() -> dict[str, float]:
    from elasticep.moe.experts.fp8_tiled import swiglu_tiled_fp8, w8a8_down, w8a8_gate_up

    out = {}
    # float32 rows: the interpreter's float32 -> bf16 cast truncates where the GPU's
    # rounds to nearest (a one-unit move that the e4m3 intermediate can amplify), so the
    # bf16 roundings run in the GPU test only. H 160 (a partial last K group), I 136 (up
    # rows start inside a scale block, a partial intermediate group), packed slot views.
    w13, s13, w2, s2, rows, tags = make_case(5, 160, 136, 24, 2, torch.float32, seed=1)
    q13, t13 = fp8_block.unpack(fp8_block.pack(w13, s13), 272)
    q2, t2 = fp8_block.unpack(fp8_block.pack(w2, s2), 160)
    case = (q13, t13, q2, t2, rows, tags)
    live = tags > 0
    bounds = expert_bounds(*case, 2, x_rounded=False, acc=0.0, sides=2)
    ref = swiglu_w8a8_reference(*case, row_repeat=2)
    # "split": the down kernel cuts the sorted rows into other blocks than gate/up's
    for name, gu, dn in (("small", (16, 4, 1), (16, 32, 4, 1)), ("default", None, None),
                         ("split", (32, 4, 1), (16, 32, 4, 1))):
        act = w8a8_gate_up(q13, t13, rows, tags, 2, gu)
        order = act.layout[0]
        q, s = unsort(act.q.view(torch.uint8), order).view(F8), unsort(act.scale, order)
        got_act = dequantize_activations(q, s)
        ref_act = w8a8_intermediate_reference(*case[:2], rows, tags, 2)
        ref_q = dequantize_activations(*quantize_activations_reference(ref_act))
        out[name + "_act"] = worst(got_act - ref_q, bounds["act"], live)
        # down on the kernel's own intermediate: float32 order and one rounding apart
        got = w8a8_down(act, q2, t2, rows.new_empty(tags.shape[0], 160), dn)
        want = w8a8_down_reference(q, s, q2, t2, tags, rows.dtype)
        out[name + "_down"] = worst(got - want, down_bound(got_act, q2, t2, tags, 0.0,
                                                           rows.dtype), live)
        out[name + "_out"] = worst(got - ref, bounds["out"], live)
        out[name + "_padding_max"] = float(got[~live].abs().max())
        out[name + "_rel"] = float((got - ref).norm() / ref.norm())
    out["whole_equals_stages"] = float(
        (swiglu_tiled_fp8(*case, row_repeat=2, gate_up_tile=(32, 4, 1),
                          down_tile=(16, 32, 4, 1)) - got).abs().max())
    return out


def test_kernels_interpreted_match_the_reference():
    errs = run_interpreted(__file__, timeout_s=180)
    assert errs.pop("whole_equals_stages") == 0, errs
    tiles = ("small", "default", "split")
    assert all(errs.pop(f"{k}_padding_max") == 0 for k in tiles), errs
    # in float32 the kernels and the reference share every rounding but the summation
    # order (float32 ulps), save where an e4m3 rounding of the intermediate then lands
    # the other way (rare): far under 2^-10 in norm, where one side without the
    # intermediate's quantization would be some 2^-5 off
    assert all(errs.pop(f"{k}_rel") < 2.0 ** -10 for k in tiles), errs
    # each the largest difference over its derived bound: at most 1
    assert len(errs) == 9 and all(v <= 1 for v in errs.values()), errs


def test_rule_sends_prefill_sized_batches_on_hopper():
    slots = 128
    big = MIN_ROWS_PER_SLOT * slots
    assert w8a8_experts_ok(big, slots, torch.bfloat16, MIN_CAPABILITY, True)
    assert w8a8_experts_ok(big, slots, torch.float16, (10, 0), True)
    assert not w8a8_experts_ok(big - 1, slots, torch.bfloat16, MIN_CAPABILITY, True)  # few
    assert not w8a8_experts_ok(big, slots, torch.bfloat16, (8, 9), True)  # no SM90 FP8 dot
    assert not w8a8_experts_ok(big, slots, torch.bfloat16, None, True)  # not CUDA
    assert not w8a8_experts_ok(big, slots, torch.float32, MIN_CAPABILITY, True)
    assert not w8a8_experts_ok(big, slots, torch.bfloat16, MIN_CAPABILITY, False)


if __name__ == "__main__":
    print(json.dumps(_interpreted_errors()))
