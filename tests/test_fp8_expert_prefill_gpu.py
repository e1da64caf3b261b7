"""The FP8 experts' prefill kernels (:mod:`elasticep.moe.experts.fp8_tiled`, W8A8 on FP8
tensor cores) compiled on the GPU, against their torch reference at Qwen3-30B-A3B's
expert shape (H 2048, I 768, 128 experts, top 8) and DeepSeek-V3's (7168, 2048, 256,
top 8), at 256, 2048 and 8192 tokens, with uneven slot counts, empty slots and padding
pairs; and ``grouped_swiglu`` on packed FP8 slots taking them at prefill sizes. Written
for an H100/H200 (SM90: the FP8 ``tl.dot``).

Each stage is checked within a bound derived from where it rounds
(elasticep_testkit/fp8_w8a8_bounds.py), the tensor cores' K-step sum allowed
:data:`~elasticep.models.fp8_prefill.ACCUMULATION_ERROR` of ``|x| @ |W|`` (what the
dense W8A8 path allows, measured on an H100):

- the quantized intermediate against the reference's intermediate quantized (both sides
  may round a group to e4m3 differently once their gate/up sums differ), and its scales;
- the down projection of the kernel's own intermediate against the float32 one;
- the output against the whole reference.
"""

from __future__ import annotations

import pytest
import torch

from elasticep.models.fp8_prefill import ACCUMULATION_ERROR
from elasticep.moe.experts import fp8_block, fp8_tiled
from elasticep.moe.experts.expert_compute import grouped_swiglu
from elasticep.moe.experts.fp8_activations import (
    FP8_MAX,
    GROUP,
    dequantize_activations,
    quantize_activations_reference,
)
from elasticep.moe.experts.fp8_sorted import swiglu_sorted_fp8
from elasticep.moe.experts.fp8_tiled import (
    MIN_CAPABILITY,
    swiglu_tiled_fp8,
    w8a8_down,
    w8a8_down_reference,
    w8a8_gate_up,
    w8a8_intermediate_reference,
)
from elasticep_testkit.fp8_w8a8_bounds import down_bound, expert_bounds, unsort, worst

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < MIN_CAPABILITY,
                                 reason="needs an SM90 GPU"),
              pytest.mark.timeout(600)]

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 256, 8)}
EMPTY = (5, 17)  # slots no pair is routed to
_experts: dict[str, tuple] = {}


@pytest.fixture(autouse=True)
def _no_tf32():
    # the references' and the bounds' float32 products must be float32, not TF32
    was, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    yield
    torch.backends.cuda.matmul.allow_tf32 = was


def experts(shape: str) -> tuple[torch.Tensor, ...]:
    """``(w13, s13, w2, s2)`` FP8 experts of ``shape``, drawn once per process: gate/up
    block scales spanning three decades over the input columns (a misplaced scale shows),
    slots differing in scale too."""
    if shape not in _experts:
        hidden, inter, slots, _ = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(hidden)
        cols = torch.logspace(-3, 0, hidden, device="cuda")
        parts = []
        for s0 in range(0, slots, 16):  # float32 draws of 16 slots at a time
            n = min(16, slots - s0)
            per_slot = torch.arange(s0, s0 + n, device="cuda").remainder(5).add(1)[:, None, None]
            w13 = torch.randn(n, 2 * inter, hidden, device="cuda", generator=gen) * cols
            w2 = torch.randn(n, hidden, inter, device="cuda", generator=gen) * 0.02
            parts.append((*fp8_block.quantize(w13 * per_slot), *fp8_block.quantize(w2)))
        _experts[shape] = tuple(torch.cat(p) for p in zip(*parts, strict=True))
    return _experts[shape]


def routing(tokens: int, slots: int, top_k: int, seed: int) -> torch.Tensor:
    """``[tokens * top_k]`` tags: each token's top-k distinct slots under a skewed
    popularity (some slots take several times their share), :data:`EMPTY` never chosen,
    one pair in 97 padding (tag 0)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bias = torch.linspace(2, -2, slots, device="cuda")[torch.randperm(slots, device="cuda",
                                                                      generator=gen)]
    bias[list(EMPTY)] = float("-inf")
    noise = -torch.log(-torch.log(torch.rand(tokens, slots, device="cuda", generator=gen)))
    tags = (noise + bias).topk(top_k, dim=1).indices.flatten() + 1
    tags[::97] = 0
    return tags


def _rows(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(tokens, hidden, device="cuda", generator=gen)
            * torch.logspace(0, -2, hidden, device="cuda")).bfloat16()


@pytest.mark.parametrize("tokens", [256, 2048, 8192])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernels_match_the_reference(shape, tokens):
    hidden, inter, slots, k = SHAPES[shape]
    w13, s13, w2, s2 = experts(shape)
    rows, tags = _rows(tokens, hidden, tokens), routing(tokens, slots, k, tokens)
    live = tags > 0
    counts = torch.bincount(tags, minlength=slots + 1)[1:]
    assert not counts[list(EMPTY)].any() and counts.max() > 2 * counts.float().mean()
    case = (w13, s13, w2, s2, rows, tags)
    bounds = expert_bounds(*case, k, x_rounded=False, acc=ACCUMULATION_ERROR, sides=2)

    act = w8a8_gate_up(w13, s13, rows, tags, k)
    order = act.layout[0]
    q = unsort(act.q.view(torch.uint8), order).view(fp8_block.FP8_DTYPE)
    s = unsort(act.scale, order)
    got_act = dequantize_activations(q, s)
    ref_act = w8a8_intermediate_reference(w13, s13, rows, tags, k)
    ref_q, ref_s = quantize_activations_reference(ref_act)
    err_act = worst(got_act - dequantize_activations(ref_q, ref_s), bounds["act"], live)
    # a group's scale is its amax over 448: it moves by the amax's move, plus a rounding
    groups = -(-inter // GROUP)
    raw = torch.nn.functional.pad(bounds["act_raw"], (0, groups * GROUP - inter))
    s_bound = raw.view(-1, groups, GROUP).amax(-1) / FP8_MAX + 2.0 ** -22 * ref_s
    err_scale = worst(s - ref_s, s_bound, live)

    got = w8a8_down(act, w2, s2, rows.new_empty(tags.shape[0], hidden))
    want_down = w8a8_down_reference(q, s, w2, s2, tags, rows.dtype)
    err_down = worst(got - want_down, down_bound(got_act, w2, s2, tags, ACCUMULATION_ERROR,
                                                 rows.dtype), live)
    ref = w8a8_down_reference(ref_q, ref_s, w2, s2, tags, rows.dtype)
    err_out = worst(got - ref, bounds["out"], live)
    # the FP8 experts with bf16 activations (today's prefill path): a few percent away,
    # the activations' e4m3 rounding (tests/test_fp8_expert_prefill.py)
    sorted_out = swiglu_sorted_fp8(w13, s13, w2, s2, rows.repeat_interleave(k, 0), tags)
    rel_sorted = float((got.float() - sorted_out.float()).norm() / sorted_out.float().norm())
    rel_ref = float((got.float() - ref.float()).norm() / ref.float().norm())
    differ = float((got_act != dequantize_activations(ref_q, ref_s))[live].float().mean())
    print(f"{shape} {tokens} tokens: act {err_act:.3g}, scales {err_scale:.3g}, down "
          f"{err_down:.3g}, out {err_out:.3g} of their bounds; intermediate elements "
          f"differing {differ:.3g}; rel to reference {rel_ref:.3g}, to fp8_sorted "
          f"{rel_sorted:.3g}")
    assert max(err_act, err_scale, err_down, err_out) <= 1
    assert not got[~live].any()
    assert 0.002 < rel_sorted < 0.1, rel_sorted
    assert torch.equal(swiglu_tiled_fp8(*case, row_repeat=k), got)  # the stages are the whole


def test_grouped_swiglu_takes_the_w8a8_kernels_at_prefill_sizes(monkeypatch):
    hidden, inter, slots, k = SHAPES["qwen3-30b-a3b"]
    w13, s13, w2, s2 = experts("qwen3-30b-a3b")
    p13, p2 = fp8_block.pack(w13, s13), fp8_block.pack(w2, s2)
    q13, t13 = fp8_block.unpack(p13, 2 * inter)
    q2, t2 = fp8_block.unpack(p2, hidden)
    rows, tags = _rows(8192, hidden, 1), routing(8192, slots, k, 1)
    assert fp8_tiled.w8a8_experts_ok(tags.shape[0], slots, rows.dtype,
                                     torch.cuda.get_device_capability(), fp8_tiled.ENABLED)
    got = grouped_swiglu(p13, p2, rows, tags, row_repeat=k)
    assert torch.equal(got, swiglu_tiled_fp8(q13, t13, q2, t2, rows, tags, row_repeat=k))
    # switched off, the sorted FP8 kernels serve the batch as before
    monkeypatch.setattr(fp8_tiled, "ENABLED", False)
    off = grouped_swiglu(p13, p2, rows, tags, row_repeat=k)
    assert torch.equal(off, swiglu_sorted_fp8(q13, t13, q2, t2, rows.repeat_interleave(k, 0),
                                              tags))
    assert not torch.equal(off, got)
    # too few pairs a slot: not these kernels
    assert not fp8_tiled.w8a8_experts_ok(2048, slots, rows.dtype, (9, 0), True)
