"""Block-FP8 checkpoints (DeepSeek-V3's and Qwen3-FP8's format) on the CPU reference path.

- the torch reference against hand-computed blocks, and its rounding bound;
- the loader on an FP8 checkpoint made from the demo model (sharded, per-expert and
  fused layouts, ``modules_to_not_convert``) against the weights it stands for;
- greedy text of that checkpoint equal to transformers run on its dequantized weights,
  in process and at EP2;
- ``--quantization fp8`` bit-identical to the offline checkpoint;
- uneven last blocks, on a random model whose widths are not multiples of 128;
- every other quantization refused in one line, before anything loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ckpt_copy import checkpoint_without, linked_checkpoint
from _fp8_ckpt import read_all, write_dequantized, write_fp8_checkpoint
from _model_helpers import rel_err

from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.request import SamplingParams
from elasticep.models import load_model
from elasticep.models.linear import Fp8Weight, dense
from elasticep.models.quantization import UnsupportedQuantizationError, parse_quantization
from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.expert_compute import dense_weights
from elasticep_testkit.ep import assert_equal_under_near_tie_rule, prompts
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.torch_threads import one_torch_thread

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
# layer 0's o_proj stays bf16, as modules_to_not_convert can ask
NOT_CONVERTED = ("lm_head", "model.layers.0.self_attn.o_proj")
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


# --- the torch reference ---------------------------------------------------------------

def test_quantize_hand_computed_blocks():
    # 130 x 260: blocks of 128 rows (then 2) by 128 columns (then 128, then 4)
    w = torch.zeros(130, 260)
    w[:128, :128] = 0.5
    w[0, 0] = 2.0                   # amax 2 -> scale 2/448; 0.5 -> 112 (exact in e4m3)
    w[128:, 256:] = -3.0            # the corner block: 2 x 4, amax 3
    w[5, 200] = 1e-3                # block (0, 1): amax 1e-3, so it maps to 448
    q, s = fp8_block.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(q.shape) == (130, 260) and tuple(s.shape) == (2, 3)
    assert s[0, 0] == pytest.approx(2.0 / 448) and s[1, 2] == pytest.approx(3.0 / 448)
    assert s[0, 1] == pytest.approx(1e-3 / 448)
    assert q[0, 1].float() == 112.0 and q[0, 0].float() == 448.0
    assert q[129, 259].float() == -448.0 and q[5, 200].float() == 448.0
    back = fp8_block.dequantize(q, s)
    # every value here is exactly representable after scaling: the round trip is exact
    # up to the one float32 rounding of q * scale
    assert torch.allclose(back, w, rtol=2 ** -23, atol=0)
    # an all-zero block keeps zeros and a finite scale
    assert bool(torch.isfinite(s).all()) and back[128, 0] == 0


def test_rounding_error_within_e4m3_bound():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen) * torch.logspace(-3, 1, 200)
    q, s = fp8_block.quantize(w)
    err = (fp8_block.dequantize(q, s) - w).abs()
    scale = fp8_block.expand_scales(s, w.shape)
    # 3 mantissa bits: half an ulp is 2^-4 relative for normals; subnormals (below
    # 2^-6 in scaled units) are spaced 2^-9, so half a step is 2^-10 absolute
    bound = w.abs() * 2 ** -4 + scale * 2 ** -10
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err / bound).max())
    with pytest.raises(ValueError, match="must be \\[3, 2\\]"):
        fp8_block.dequantize(q, s[:2])
    with pytest.raises(ValueError, match="inf or NaN"):
        fp8_block.quantize(torch.tensor([[float("nan")]]))


# --- refusals --------------------------------------------------------------------------

REFUSED = [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "compressed-tensors"}, "'compressed-tensors'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "mxfp4"}, "'mxfp4'"),
    ({}, "names no quant_method"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor scales"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size \\[64, 64\\]"),
    ({"quant_method": "fp8", "weight_block_size": "128"}, "weight_block_size '128' "),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "static"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
]


@pytest.mark.parametrize("qc, named", REFUSED, ids=[q.get("quant_method", "none") + str(i)
                                                    for i, (q, _) in enumerate(REFUSED)])
def test_unsupported_quantization_is_refused(qc, named):
    with pytest.raises(UnsupportedQuantizationError, match=named) as exc:
        parse_quantization({"quantization_config": qc})
    assert "\n" not in str(exc.value) and "supported: block-scaled FP8" in str(exc.value)


def _with_quant_config(tmp_path: Path, qc: dict) -> Path:
    return linked_checkpoint(DEMO_MODEL, tmp_path / "ckpt", "config.json",
                             lambda config: {**config, "quantization_config": qc})


def test_serve_refuses_awq_in_one_line_before_loading(tmp_path):
    ckpt = _with_quant_config(tmp_path, {"quant_method": "awq", "bits": 4})
    run = subprocess.run([sys.executable, "-m", "elasticep.entrypoints.cli", "serve",
                          "--model", str(ckpt), "--ep-size", "2"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0, run.stderr
    assert "quantization method 'awq' is not supported" in run.stderr
    with pytest.raises(UnsupportedQuantizationError):
        load_model(ckpt, progress=False)  # the library refuses it too


def test_fp8_tensors_without_quantization_config_are_refused(fp8_ckpt, tmp_path):
    bare = linked_checkpoint(fp8_ckpt, tmp_path / "bare", "config.json", lambda config: {
        k: v for k, v in config.items() if k != "quantization_config"})
    with pytest.raises(ValueError, match="stored as float8_e4m3fn"):
        load_model(bare, progress=False)
    # and the commands refuse it in one line before any rank starts (it was a rank's
    # traceback), with the config's key removed or set to null
    nulled = linked_checkpoint(fp8_ckpt, tmp_path / "nulled", "config.json", lambda config: {
        **config, "quantization_config": None})
    for ckpt in (bare, nulled):
        run = subprocess.run([sys.executable, "-m", "elasticep.entrypoints.cli", "serve",
                              "--model", str(ckpt), "--ep-size", "1", "--device", "cpu"],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert run.returncode == 2, run.stderr
        assert run.stderr.strip().count("\n") == 0, run.stderr
        assert "is stored as F8_E4M3, but config.json declares no quantization_config" \
            in run.stderr


def test_an_fp8_weight_without_its_scales_is_named_so(fp8_ckpt, tmp_path):
    """A declared block-FP8 checkpoint missing one weight's scales: the error names the
    missing scales (it said the config declared no quantization)."""
    key = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    ckpt = checkpoint_without(fp8_ckpt, tmp_path / "noscale", key)
    with pytest.raises(ValueError, match=f"its block scales '{key}' are missing"):
        load_model(ckpt, progress=False)


# --- the loader ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return write_fp8_checkpoint(DEMO_MODEL, tmp_path_factory.mktemp("fp8"), NOT_CONVERTED)


@pytest.fixture(scope="module")
def dequantized_ckpt(fp8_ckpt, tmp_path_factory):
    return write_dequantized(fp8_ckpt, tmp_path_factory.mktemp("fp8_dequantized"))


@pytest.fixture(scope="module")
def fp8_model(fp8_ckpt):
    return load_model(fp8_ckpt, progress=False)


def _weights(model) -> dict[str, torch.Tensor]:
    """Every weight as the forward pass sees it (FP8 projections and packed FP8 experts
    dequantized)."""
    out = {"embed": model.embed, "lm_head": model.lm_head}
    for i, layer in enumerate(model.layers):
        out[f"{i}.qkv"] = dense(layer.attn.qkv, torch.float32)
        out[f"{i}.o"] = dense(layer.attn.o, torch.float32)
        out[f"{i}.router"] = layer.moe.router
        out[f"{i}.w13"], out[f"{i}.w2"] = dense_weights(model.experts.w13[i],
                                                        model.experts.w2[i], torch.float32)
    return out


def test_loader_dequantizes_exactly(fp8_ckpt, fp8_model, dequantized_ckpt):
    ours = _weights(fp8_model)
    want = _weights(load_model(dequantized_ckpt, progress=False))
    for name, w in want.items():
        assert torch.equal(ours[name], w), name
    stored = read_all(fp8_ckpt)
    # the experts stay FP8: each slot holds the stored bytes and scales, packed
    q13, s13 = fp8_block.unpack(fp8_model.experts.w13[3], 512)
    gate = "model.layers.3.mlp.experts.9.gate_proj.weight"
    up = "model.layers.3.mlp.experts.9.up_proj.weight"
    assert fp8_model.experts.w13[3].dtype == torch.uint8
    assert torch.equal(q13[9].view(torch.uint8),
                       torch.cat([stored[gate], stored[up]]).view(torch.uint8))
    assert torch.equal(s13[9], torch.cat([stored[gate + "_scale_inv"], stored[up + "_scale_inv"]]))
    # what stayed unconverted is the original weight; the rest really moved through FP8
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv" not in stored
    assert "model.layers.1.self_attn.o_proj.weight_scale_inv" in stored
    assert "model.layers.0.mlp.gate.weight_scale_inv" not in stored
    orig = read_all(DEMO_MODEL)
    # the projections stay FP8 as stored, but the one modules_to_not_convert names
    o1 = fp8_model.layers[1].attn.o
    assert isinstance(o1, Fp8Weight) and isinstance(fp8_model.layers[0].attn.o, torch.Tensor)
    assert torch.equal(o1.q.view(torch.uint8),
                       stored["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8))
    assert torch.equal(o1.scale_inv, stored["model.layers.1.self_attn.o_proj.weight_scale_inv"])
    assert torch.equal(ours["0.o"], orig["model.layers.0.self_attn.o_proj.weight"].float())
    assert not torch.equal(ours["1.o"], orig["model.layers.1.self_attn.o_proj.weight"].float())


def test_fused_expert_layout_loads_the_same_experts(fp8_ckpt, tmp_path):
    fused = write_fp8_checkpoint(DEMO_MODEL, tmp_path / "fused", NOT_CONVERTED, shards=2, fused=True)
    assert "model.layers.0.mlp.experts.gate_up_proj_scale_inv" in read_all(fused)
    a = load_model(fused, progress=False, slot_to_logical=torch.tensor([[3, 15, 0]] * 6))
    b = load_model(fp8_ckpt, progress=False, slot_to_logical=torch.tensor([[3, 15, 0]] * 6))
    for i in range(6):
        assert torch.equal(a.experts.w13[i], b.experts.w13[i])
        assert torch.equal(a.experts.w2[i], b.experts.w2[i])


def test_online_quantization_is_bit_identical_to_the_checkpoint(fp8_model):
    online = _weights(load_model(DEMO_MODEL, progress=False, quantization="fp8"))
    offline = _weights(fp8_model)
    plain = _weights(load_model(DEMO_MODEL, progress=False))
    for name, w in offline.items():
        if name == "0.o":  # not converted in the checkpoint; --quantization converts it
            assert not torch.equal(online[name], w)
            continue
        assert torch.equal(online[name], w), name
    assert torch.equal(online["3.router"], plain["3.router"])
    assert not torch.equal(online["3.w13"], plain["3.w13"])


def test_dummy_weights_of_an_fp8_config_are_fp8_values(tmp_path):
    only = tmp_path / "cfg"
    only.mkdir()
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (only / "config.json").write_text(json.dumps(config))
    model = load_model(only, load_format="dummy", progress=False)
    w = dense_weights(model.experts.w13[2], model.experts.w2[2], torch.float32)[0][5]
    q, s = fp8_block.quantize(w)
    assert torch.equal(fp8_block.dequantize(q, s), w)  # already on the FP8 grid
    assert not torch.equal(model.layers[0].moe.router,
                           fp8_block.fake_quantize(model.layers[0].moe.router))


# --- greedy text against transformers on the dequantized weights -----------------------

@pytest.fixture(scope="module")
def hf_reference(dequantized_ckpt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(dequantized_ckpt, dtype=torch.float32).eval()
    refs, margins = [], []
    with torch.no_grad():
        for p in prompts()[:6]:
            out = hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False, output_logits=True, return_dict_in_generate=True)
            refs.append(out.sequences[0, len(p):].tolist())
            margins.append([float(torch.topk(lg[0], 2).values.diff().abs()) for lg in out.logits])
    return refs, margins


def test_fp8_greedy_matches_transformers_on_dequantized_weights(fp8_model, hf_reference):
    engine = LLMEngine(fp8_model)
    outs = engine.generate([list(p) for p in prompts()[:6]], GREEDY)
    refs, margins = hf_reference
    assert_equal_under_near_tie_rule(outs, refs, margins, "fp8 engine vs transformers")
    # the FP8 text is not the unquantized model's: the test would see a loader that
    # ignored the scales (the unquantized reference differs on these prompts)
    plain = LLMEngine.from_pretrained(DEMO_MODEL, dtype=torch.float32, progress=False)
    assert plain.generate([list(p) for p in prompts()[:6]], GREEDY) != refs


def test_fp8_ep2_generate_matches_transformers(fp8_ckpt, hf_reference, tmp_path):
    from elasticep_testkit.ep import tokenizer

    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": tokenizer().decode(list(p))})
                           for p in prompts()[:3]))
    run = subprocess.run(
        [sys.executable, "-m", "elasticep.entrypoints.cli", "generate", "--model", str(fp8_ckpt),
         "--prompts-file", str(f), "--max-tokens", "16", "--ep-size", "2",
         "--ep-num-redundant-experts", "2"],
        capture_output=True, text=True, timeout=150, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    got = [json.loads(line)["token_ids"] for line in run.stdout.splitlines()]
    refs, margins = hf_reference
    eos = 0  # the demo model's: generate stops there (the reference ran past it)
    assert all(len(g) == 16 or g[-1] == eos for g in got), got
    assert_equal_under_near_tie_rule(got, [r[:len(g)] for r, g in zip(refs, got, strict=False)],
                                     margins[:3], "fp8 EP2 vs transformers")


# --- uneven last blocks ----------------------------------------------------------------

def test_uneven_blocks_match_transformers_logits(tmp_path):
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(vocab_size=300, hidden_size=160, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=40,
                            max_position_embeddings=128, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=72, intermediate_size=200,
                            norm_topk_prob=True)
    torch.manual_seed(0)
    hf = tf.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape) if "norm" in name else 0.08 * torch.randn(p.shape))
    hf.save_pretrained(tmp_path / "plain")
    fp8 = write_fp8_checkpoint(tmp_path / "plain", tmp_path / "fp8", ("lm_head",), shards=2)
    stored = read_all(fp8)
    # 72 x 160 -> 1 x 2 blocks; 160 x 72 -> 2 x 1; 160 x 160 (q) -> 2 x 2
    assert tuple(stored["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"].shape) == (1, 2)
    assert tuple(stored["model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"].shape) == (2, 1)
    deq = write_dequantized(fp8, tmp_path / "deq")
    ref = tf.Qwen3MoeForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    ours = load_model(fp8, progress=False)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits[0]
    from _model_helpers import run_batched

    got = run_batched(ours, [ids[0].tolist()], split=1)[0]
    assert rel_err(got, want) < 1e-4


# --- elastic paths: an orphan reloaded, or read for a peer, is the expert it replaces ---

def test_orphan_reload_and_joiner_read_are_bit_identical(fp8_ckpt, fp8_model):
    from elasticep.elastic.rank_model import CheckpointExperts
    from elasticep.models import reload_expert

    part = load_model(fp8_ckpt, progress=False, slot_to_logical=torch.tensor([[0, 1]] * 6))
    reload_expert(part, fp8_ckpt, layer=4, slot=1, logical_expert=11)
    assert torch.equal(part.experts.w13[4][1], fp8_model.experts.w13[4][11])
    assert torch.equal(part.experts.w2[4][1], fp8_model.experts.w2[4][11])
    w13, w2 = CheckpointExperts(part, fp8_ckpt)(2, 7)
    assert torch.equal(w13, fp8_model.experts.w13[2][7]) and torch.equal(w2, fp8_model.experts.w2[2][7])
    # online: a reload rounds through FP8 exactly as the launch did
    online = load_model(DEMO_MODEL, progress=False, quantization="fp8",
                        slot_to_logical=torch.tensor([[5]] * 6))
    w13, _ = CheckpointExperts(online, DEMO_MODEL, quantization="fp8")(3, 5)
    assert torch.equal(w13, online.experts.w13[3][0])
    plain, _ = CheckpointExperts(online, DEMO_MODEL)(3, 5)
    assert not torch.equal(plain, w13)


def test_llm_refuses_an_unsupported_quantization_before_any_rank_starts(tmp_path):
    from elasticep import LLM
    from elasticep.entrypoints.validate import UsageError

    ckpt = _with_quant_config(tmp_path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(UsageError, match="quantization method 'gptq' is not supported"):
        LLM(model=str(ckpt), ep_size=1)
