"""Our forward pass vs transformers on tiny random-init checkpoints of every family/layout.

Checkpoints are written with ``save_pretrained`` (per-expert layout; qwen3_moe sharded);
the fused layouts (``mlp.experts.gate_up_proj`` / ``down_proj``) are written from the
module state dict with safetensors by hand, since transformers 5 saves per-expert keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _model_helpers import rel_err as _rel
from _model_helpers import run_batched
from safetensors.torch import save_file

from elasticep.models import load_model, reload_expert
from elasticep.models.checkpoint import CheckpointReader

pytestmark = pytest.mark.timeout(300)

COMMON = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, num_experts_per_tok=2,
)
PROMPT_LENS = (5, 11, 17, 8)


def _hf_model(family: str):
    import transformers as tf

    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=32,
                                intermediate_size=96, head_dim=16, norm_topk_prob=True)
        return tf.Qwen3MoeForCausalLM(cfg)
    if family == "qwen2_moe":
        # layer 1 dense (mlp_only_layers), shared expert, qkv bias, no norm_topk_prob, tied head
        cfg = tf.Qwen2MoeConfig(**COMMON, num_experts=6, moe_intermediate_size=32,
                                intermediate_size=96, shared_expert_intermediate_size=48,
                                mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=True)
        return tf.Qwen2MoeForCausalLM(cfg)
    cfg = tf.MixtralConfig(**COMMON, num_local_experts=4, intermediate_size=32, sliding_window=None)
    return tf.MixtralForCausalLM(cfg)


def _randomize(model, seed: int) -> None:
    # transformers' init leaves some weights zero/one (routers, norms); spread them so
    # routing has no ties and every tensor matters.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)


def _write(family: str, layout: str, out: Path) -> tuple[Path, object]:
    model = _hf_model(family).eval()
    _randomize(model, seed=CASES.index((family, layout)) + 1)
    if layout == "per_expert":
        model.save_pretrained(out, max_shard_size="100KB" if family == "qwen3_moe" else "50MB")
    else:
        model.config.save_pretrained(out)
        sd = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        save_file(sd, str(out / "model.safetensors"))
    return out, model


CASES = [("qwen3_moe", "per_expert"), ("qwen3_moe", "fused"), ("qwen2_moe", "per_expert"),
         ("mixtral", "per_expert"), ("mixtral", "fused")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def checkpoint(request, tmp_path_factory):
    family, layout = request.param
    path, ref = _write(family, layout, tmp_path_factory.mktemp(f"{family}_{layout}"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        ref_logits = [ref(torch.tensor([p])).logits[0].float() for p in prompts]
    return family, layout, path, prompts, ref_logits


def test_logits_match_transformers(checkpoint):
    family, layout, path, prompts, ref_logits = checkpoint
    model = load_model(path, progress=False)
    assert model.config.model_type == family
    for ours, ref in zip(run_batched(model, prompts, split=3), ref_logits, strict=True):
        assert _rel(ours, ref) <= 1e-4, f"{family}/{layout}: rel err {_rel(ours, ref):.2e}"


def test_placement_loads_only_assigned_experts(checkpoint, monkeypatch):
    family, layout, path, prompts, ref_logits = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
    # reversed order plus a replica of expert 0: every expert still present
    row = list(reversed(range(num_experts))) + [0]
    s2l = torch.tensor([row, row])
    seen: list[tuple[str, int | None]] = []
    get, get_row = CheckpointReader.get, CheckpointReader.get_row
    monkeypatch.setattr(CheckpointReader, "get", lambda s, k, *a, **kw: seen.append((k, None)) or get(s, k, *a, **kw))
    monkeypatch.setattr(
        CheckpointReader, "get_row",
        lambda s, k, r, *a, **kw: seen.append((k, r)) or get_row(s, k, r, *a, **kw),
    )
    model = load_model(path, slot_to_logical=s2l, progress=False)
    ours = run_batched(model, prompts[:2], split=1)
    for o, r in zip(ours, ref_logits[:2], strict=True):
        assert _rel(o, r) <= 1e-4

    # a rank holding experts {1, 2} only reads those experts' tensors
    seen.clear()
    part = load_model(path, slot_to_logical=torch.tensor([[1, 2], [2, 1]]), progress=False)
    expert_reads = [(k, r) for k, r in seen if ".experts." in k]
    assert expert_reads
    for key, r in expert_reads:
        expert = r if r is not None else int(key.split(".experts.")[1].split(".")[0])
        assert expert in (1, 2), key
    with pytest.raises(ValueError, match="no local slot"):
        run_batched(part, prompts[:1], split=1)

    # orphan reload: overwrite slot 0 with expert 0, then restore expert 1
    reload_expert(part, path, layer=0, slot=0, logical_expert=0)
    assert part.experts.slot_to_logical[0].tolist() == [0, 2]
    moe_layer = model.config.moe_layer_ids[0]
    ref_slot = row.index(0)
    assert torch.equal(part.experts.w13[moe_layer][0], model.experts.w13[moe_layer][ref_slot])


def test_errors_are_one_line_and_name_families(tmp_path, checkpoint):
    _, _, path, _, _ = checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama'.*qwen3_moe, qwen2_moe, mixtral"):
        load_model(bad, progress=False)

    from safetensors.torch import load_file

    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    miss = tmp_path / "missing"
    miss.mkdir()
    (miss / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v for k, v in sd.items() if "post_attention_layernorm" not in k}, str(miss / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor .*post_attention_layernorm.*supported") as exc:
        load_model(miss, progress=False)
    assert "\n" not in str(exc.value)

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text((path / "config.json").read_text())
    sd["model.norm.weight"] = torch.ones(3)
    save_file(sd, str(wrong / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.norm.weight' has shape \[3\], expected \[64\]"):
        load_model(wrong, progress=False)
