"""FP8 dense projections kept FP8 in memory (:mod:`elasticep.models.linear`), on the CPU.

An FP8 model (``--quantization fp8``, or a stored FP8 checkpoint) holds its attention,
MLA, shared-expert and dense-MLP projections as block FP8, and computes what the same
model with those weights dequantized at load (the path before them) computes: equal
logits (the reference matmul is that path's float32 matmul) and the same greedy
tokens, on the demo model, and on tiny DeepSeek-V2-Lite/V3 FP8 checkpoints against the
plain checkpoints of their dequantized weights (plain q_proj, query LoRA, MLA's rotary
rows permuted inside their scale blocks, shared experts, a dense first layer, gate and
up fused where their scale grids stack). Its dense projections take 1 byte a weight plus their scales, and
``bench/scale.py``'s HBM bound counts exactly those bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _deepseek_ckpt import build
from _fp8_ckpt import write_dequantized, write_fp8_checkpoint
from _model_helpers import rel_err, run_batched

from bench.step_bytes import step_bytes
from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.request import SamplingParams
from elasticep.models import load_model, load_model_config
from elasticep.models.linear import Fp8Weight, dense, weight_bytes
from elasticep.models.loader import _deinterleaved
from elasticep.models.mla import MLAWeights
from elasticep.models.rope import deinterleave_rows
from elasticep.moe.experts import fp8_block
from elasticep_testkit.ep import prompts
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.torch_threads import one_torch_thread

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
ATTN = ("q", "k", "v", "o", "qkv", "q_a", "q_b", "kv_a", "kv_b")
MLP = ("gate", "up", "down")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def projections(model) -> dict[str, object]:
    """Every dense projection of ``model`` by name (the fused qkv, not its views)."""
    out = {}
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        fused = getattr(attn, "qkv", None) is not None
        for name in ATTN:
            if hasattr(attn, name) and getattr(attn, name) is not None and not (
                    fused and name in ("q", "k", "v")):
                out[f"{i}.{name}"] = getattr(attn, name)
        for part, mlp in (("shared", layer.moe and layer.moe.shared), ("mlp", layer.mlp)):
            if mlp is None:
                continue
            for name in ("gate_up", "down") if mlp.gate_up is not None else MLP:
                out[f"{i}.{part}.{name}"] = getattr(mlp, name)
    return out


def dequantized_copy(path: Path, **load) -> object:
    """The model as the loader built it before FP8 projections: each one dequantized
    exactly into the model dtype (fused q/k/v re-split as views)."""
    model = load_model(path, progress=False, **load)
    for layer in model.layers:
        a = layer.attn
        for name in ATTN:
            w = getattr(a, name, None)
            if isinstance(w, Fp8Weight):
                setattr(a, name, dense(w, model.dtype))
        if not isinstance(a, MLAWeights) and a.qkv is not None:
            a.q, a.k, a.v = a.qkv.split([a.q.shape[0], a.k.shape[0], a.v.shape[0]])
        for mlp in (layer.moe and layer.moe.shared, layer.mlp):
            for name in MLP if mlp is not None else ():
                setattr(mlp, name, dense(getattr(mlp, name), model.dtype))
            if mlp is not None:
                mlp.gate_up = None
    return model


def test_demo_model_fp8_projections_compute_the_dequantized_model():
    fp8 = load_model(DEMO_MODEL, progress=False, quantization="fp8")
    old = dequantized_copy(DEMO_MODEL, quantization="fp8")
    ps = projections(fp8)
    assert sorted(ps) == sorted(f"{i}.{n}" for i in range(6) for n in ("qkv", "o"))
    assert all(isinstance(w, Fp8Weight) for w in ps.values())
    # bytes: 1 a weight plus 4 a 128 x 128 block's scale; qkv [256 + 128 + 128, 256] and
    # o [256, 256] a layer, against 4 bytes a weight dequantized in float32
    per_layer = (512 * 256 + 4 * 4 * 2) + (256 * 256 + 4 * 2 * 2)
    assert sum(weight_bytes(w) for w in ps.values()) == 6 * per_layer
    assert sum(weight_bytes(w) for w in projections(old).values()) == 6 * 4 * (512 + 256) * 256
    qkv = fp8.layers[2].attn.qkv
    assert qkv.q.dtype == torch.float8_e4m3fn and qkv.scale_inv.dtype == torch.float32
    assert tuple(qkv.scale_inv.shape) == (4, 2)
    # what the format keeps unquantized stays in the model dtype
    assert fp8.embed.dtype == fp8.lm_head.dtype == fp8.layers[0].moe.router.dtype == torch.float32
    # logits of a prefill, then a decode step over the cache
    ids = [list(p) for p in prompts()[:4]]
    logits = run_batched(fp8, ids, split=1)
    for got, want in zip(logits, run_batched(old, ids, split=1), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert LLMEngine(fp8).generate(ids[:2], GREEDY) == LLMEngine(old).generate(ids[:2], GREEDY)
    # and they are FP8's logits, not the unquantized model's
    plain = run_batched(load_model(DEMO_MODEL, progress=False), ids[:1], split=1)[0]
    assert rel_err(logits[0], plain) > 1e-3


@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
def test_deepseek_fp8_checkpoint_computes_its_dequantized_weights(variant, tmp_path):
    # the reference is the plain checkpoint of the weights the FP8 one stands for, loaded
    # as any unquantized model (its rotary rows permuted as plain tensors)
    # v3: the dense layer's and the shared experts' intermediate sizes are 128, so their
    # FP8 gate and up fuse into one weight; v2_lite's (96, 64) keep two
    fused = variant == "v3"
    sizes = dict(intermediate_size=128, moe_intermediate_size=64) if fused else {}
    build(variant, tmp_path / "plain", seed=3, **sizes)
    ckpt = write_fp8_checkpoint(tmp_path / "plain", tmp_path / "fp8", ("lm_head",), shards=1)
    fp8 = load_model(ckpt, progress=False)
    old = load_model(write_dequantized(ckpt, tmp_path / "deq"), progress=False)
    ps = projections(fp8)
    q = ("q",) if variant == "v2_lite" else ("q_a", "q_b")
    mlp = ("gate_up", "down") if fused else MLP
    want_fp8 = {f"{i}.{n}" for i in range(3) for n in (*q, "kv_a", "o")}
    want_fp8 |= {f"0.mlp.{n}" for n in mlp}  # the dense first layer
    want_fp8 |= {f"{i}.shared.{n}" for i in (1, 2) for n in mlp}
    assert {k for k, w in ps.items() if isinstance(w, Fp8Weight)} == want_fp8
    assert all(isinstance(fp8.layers[i].attn.kv_b, torch.Tensor) for i in range(3))
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 8192, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    # split 1: the last token is a decode step (MLA's absorbed form)
    for got, want in zip(run_batched(fp8, ids, split=1), run_batched(old, ids, split=1), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert LLMEngine(fp8).generate(ids, GREEDY) == LLMEngine(old).generate(ids, GREEDY)
    # the HBM bound's bytes are the bytes this model holds (kv_b at float32's 4)
    parts = step_bytes(fp8.config, 4, [0, 0], [])
    assert parts["attention_weights"] + parts["dense_mlps"] == sum(map(weight_bytes, ps.values()))


def test_step_bytes_counts_the_fp8_projections_a_model_holds(tmp_path):
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.self_attn.o_proj"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path, load_format="dummy", progress=False, dtype=torch.bfloat16)
    ps = projections(model)
    assert isinstance(ps["0.o"], torch.Tensor) and isinstance(ps["1.o"], Fp8Weight)
    parts = step_bytes(model.config, 2, [0] * 6, [])
    assert parts["attention_weights"] == sum(map(weight_bytes, ps.values()))
    assert parts["dense_mlps"] == 0
    plain = step_bytes(load_model_config(DEMO_MODEL), 2, [0] * 6, [])
    assert plain["attention_weights"] == 6 * 2 * (512 + 256) * 256


def test_rotary_rows_keep_their_scales_only_inside_a_block():
    q, s = fp8_block.quantize(torch.randn(320, 96, generator=torch.Generator().manual_seed(0)))
    w = Fp8Weight(q, s)
    # 2 heads of 160 rows, rotary rows from 128 of each: head 0's stay in rows 128..159
    # of block 1, head 1's in 288..319 of block 2, so the scales stay as they are
    kept = _deinterleaved(w, 2, 160, 128, torch.float32)
    assert isinstance(kept, Fp8Weight) and kept.scale_inv is s
    assert torch.equal(kept.dequantize(torch.float32),
                       deinterleave_rows(w.dequantize(torch.float32), 2, 160, 128))
    # rotary rows from 96: row 97 would move to 128, into the next block's scale
    moved = _deinterleaved(w, 2, 160, 96, torch.float32)
    assert isinstance(moved, torch.Tensor)
    assert torch.equal(moved, deinterleave_rows(w.dequantize(torch.float32), 2, 160, 96))
    with pytest.raises(ValueError, match="scale block"):
        w.permute_rows(torch.arange(320).roll(1))
