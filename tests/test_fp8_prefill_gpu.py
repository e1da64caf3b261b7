"""The FP8 prefill path on the GPU: the blockwise ``scaled_mm`` probe's answer, the
activation quantizer compiled (bit for bit against its torch reference), the W8A8
product against :func:`~elasticep.models.fp8_prefill.w8a8_reference` at Qwen3-30B-A3B's
and DeepSeek-V3's projection shapes (bf16 and fp16, with a bias, M = 256, 1000, 8192),
one capture in a CUDA graph, and the demo model's prefill logits against the float32
path. Written for an H100 (SM90; the recipe is SM90-only in PyTorch)."""

from __future__ import annotations

import pytest
import torch
from _model_helpers import engine_prefill_logits

import elasticep.models.linear as linear_mod
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.models import fp8_prefill as fp
from elasticep.models import load_model
from elasticep.models.fp8_linear import fp8_linear_reference, fp8_linear_triton
from elasticep.models.linear import Fp8Weight, linear
from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_activations import (
    quantize_activations,
    quantize_activations_reference,
)
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(300)]

# (N, K): Qwen3-30B-A3B's fused qkv and o; DeepSeek-V3's q_a, q_b, kv_a (576 rows: a
# partial weight block), o, shared gate and down, dense-layer gate (bench/fp8_linear.py)
SHAPES = [(5120, 2048), (2048, 4096), (1536, 7168), (24576, 1536), (576, 7168),
          (7168, 16384), (2048, 7168), (7168, 2048), (18432, 7168)]


@pytest.fixture(autouse=True)
def _float32_references():
    # the references' float32 products must not run in TF32
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    """On the GPU: activations ``[m, k]`` spanning two decades across columns, an FP8
    weight whose block scales span three (a misplaced scale shows), and a bias."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * torch.logspace(-3, 0, k, device="cuda")
    q, s = fp8_block.quantize(w)
    x = torch.randn(m, k, device="cuda", generator=gen) * torch.logspace(0, -2, k, device="cuda")
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
    return x.to(dtype), q, s, b


def test_probe_finds_the_blockwise_recipe_on_this_gpu():
    support = fp.blockwise_support(torch.device("cuda"))
    print(f"probe: {support}")
    assert support.usable, support.reason
    # the demo model (K/128 = 2), DeepSeek-V3's kv_a (576 rows) and fp16 models need these
    assert support.padded_scales and support.partial_n and support.fp16, support
    assert fp.blockwise_support(torch.device("cuda")) is support  # cached


def test_quantizer_compiled_is_the_reference_bit_for_bit():
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1000, 7168, device="cuda", generator=gen) * torch.logspace(
        -3, 2, 7168, device="cuda")
    x[7] = 0
    x[9, 300] = 3e4
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xt = x.to(dtype)
        q, s = quantize_activations(xt, fp.ROW_MULTIPLE)
        qr, sr = quantize_activations_reference(xt)
        assert q.shape == (1008, 7168) and s.stride() == (1, 1008), dtype
        # Values, not bytes: where a negative value rounds to zero the kernel writes +0
        # and the reference -0 (how the kernel's negation treats a zero: not looked
        # into); so it was on an H100 in every differing byte printed
        assert torch.equal(q[:1000].float(), qr.float()), dtype
        assert torch.equal(s[:1000], sr), dtype
        assert not q[1000:].float().any(), dtype


def _worst(got: torch.Tensor, x, q, s, b) -> float:
    """The largest ``|got - w8a8_reference|`` over :func:`w8a8_error_bound`."""
    ref = fp.w8a8_reference(x, q, s, b).float()
    return float(((got.float() - ref).abs() / fp.w8a8_error_bound(x, q, s, b)).max())


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [256, 1000, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_matches_its_reference(m, n, k, dtype):
    x, q, s, b = _case(m, n, k, dtype, bias=m == 1000, seed=n + k + m)
    got = fp.fp8_linear_w8a8(x, q, s, b)
    assert got.dtype == dtype and got.shape == (m, n)
    assert _worst(got, x, q, s, b) <= 1  # see w8a8_error_bound
    # against the exact product (weights dequantized, activations not quantized): the
    # activations' own rounding, a few percent (tests/test_fp8_prefill.py)
    exact = fp8_linear_reference(x, q, s, b).float()
    rel = float((got.float() - exact).norm() / exact.norm())
    assert 0.002 < rel < 0.05, rel
    # and the dispatch sends this shape there
    assert fp.choose_path(m, n, k, dtype, fp.blockwise_support(x.device)) == "w8a8"


def test_w8a8_through_linear_eager_and_captured():
    x, q, s, b = _case(256, 5120, 2048, torch.bfloat16, bias=True, seed=3)
    w = Fp8Weight(q, s)
    eager = linear(x, w, b)
    assert _worst(eager, x, q, s, b) <= 1
    # the weight-only kernel (activations not quantized) lands outside that bound: so
    # linear() took the W8A8 path
    assert _worst(fp8_linear_triton(x, q, s, b), x, q, s, b) > 1
    # activations that are a column slice of a wider tensor (row stride 2057)
    wide = torch.cat([x, x[:, :9]], dim=1)[:, :2048]
    assert _worst(fp.fp8_linear_w8a8(wide, q, s, b), x, q, s, b) <= 1
    # decode graphs capture up to batch 256: the W8A8 path must capture and replay
    static = x.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(static, w, b)
    fresh = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda")
                        .manual_seed(4)).bfloat16()
    static.copy_(fresh)
    graph.replay()
    assert _worst(out, fresh, q, s, b) <= 1
    assert not torch.equal(out, eager)


LENGTHS = [300, 200, 37]  # one prefill step of 537 rows: the W8A8 path


def _prefill_logits(model) -> torch.Tensor:
    eng = LLMEngine(model, EngineConfig(max_total_tokens=4096, max_num_seqs=16,
                                        enable_cuda_graph=False))
    return engine_prefill_logits(eng, LENGTHS, 1000)


def test_demo_model_prefill_logits_stay_within_the_activation_rounding(monkeypatch):
    gpu = load_model(DEMO_MODEL, progress=False, dtype=torch.bfloat16, device="cuda",
                     quantization="fp8")
    qkv = gpu.layers[0].attn.qkv
    assert isinstance(qkv, Fp8Weight)
    support = fp.blockwise_support(torch.device("cuda"))
    assert fp.choose_path(sum(LENGTHS), *qkv.shape, torch.bfloat16, support) == "w8a8", support
    w8a8 = _prefill_logits(gpu)
    # the float32 path: the FP8 weights dequantized exactly, activations not quantized
    ref = _prefill_logits(load_model(DEMO_MODEL, progress=False, quantization="fp8"))
    # the W8A8 numerics emulated on the CPU in float32 (w8a8_reference per projection):
    # on this model its logits are 5.34e-2 (norm) from the float32 path's, with 0.931
    # argmax agreement (run on the CPU); the bf16 weight-only path's (CPU) are 2.03e-2
    monkeypatch.setattr(linear_mod, "fp8_project", fp.w8a8_reference)
    emu = _prefill_logits(load_model(DEMO_MODEL, progress=False, quantization="fp8"))
    monkeypatch.undo()
    monkeypatch.setattr(fp, "W8A8_MIN_M", 1 << 30)  # this process: weight-only everywhere
    weight_only = _prefill_logits(gpu)

    def dist(a, b_):
        return float((a - b_).norm() / b_.norm())

    err, err_emu, err_wo = dist(w8a8, ref), dist(emu, ref), dist(weight_only, ref)
    agree = float((w8a8.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"prefill logits vs float32: W8A8 {err:.3e} (CPU emulation {err_emu:.3e}, "
          f"weight-only bf16 {err_wo:.3e}); W8A8 vs emulation {dist(w8a8, emu):.3e}; "
          f"argmax agreement {agree:.4f}")
    # The bound: the two sources add at most (triangle inequality), the activations'
    # rounding as emulated and the bf16 rounding of everything else as the weight-only
    # path shows it on this GPU (0.0398 on an H100 for shorter prompts), with a tenth
    # for their interplay; independent, they add nearer in quadrature. On the CPU a
    # bf16 model with w8a8_reference projections gave 5.27e-2 and 0.918 agreement.
    assert err <= 1.1 * (err_emu + err_wo) and agree > 0.8, (err, err_emu, err_wo, agree)
    # and the W8A8 path ran: its logits are not the weight-only path's (the bf16 noise
    # alone makes W8A8-vs-emulation no closer than W8A8-vs-float32, so that is no test)
    assert dist(w8a8, weight_only) > 1e-2, dist(w8a8, weight_only)
