"""Our RoPE tables vs transformers' own (Qwen3-MoE rotary embedding), past the original context.

Also checks that ``rope_scaling`` (older configs) and ``rope_parameters`` (transformers 5)
parse alike, and that an unsupported type is a one-line error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elasticep.models.config import load_model_config
from elasticep.models.rope import parse_rope, rope_cos_sin

pytestmark = pytest.mark.timeout(60)

HEAD_DIM, ORIG, MAX_POS = 32, 64, 256
SCALINGS = {
    "default": {},
    "linear": {"factor": 3.0},
    "dynamic": {"factor": 2.5},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": ORIG, "beta_fast": 24,
             "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.6},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIG},
}


def _hf_tables(rope_type: str, positions: torch.Tensor):
    import transformers as tf

    params = {"rope_type": rope_type, "rope_theta": 5000.0, **SCALINGS[rope_type]}
    cfg = tf.Qwen3MoeConfig(hidden_size=64, num_attention_heads=2, head_dim=HEAD_DIM,
                            max_position_embeddings=MAX_POS, rope_parameters=params)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    emb = Qwen3MoeRotaryEmbedding(cfg)
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("rope_type", list(SCALINGS))
def test_tables_match_transformers(rope_type):
    # dynamic only departs from default past max_position_embeddings
    end = MAX_POS + 96 if rope_type == "dynamic" else ORIG + 160
    positions = torch.arange(end - 128, end)
    raw = {"rope_scaling": {"type": rope_type, **SCALINGS[rope_type]}, "rope_theta": 5000.0}
    rope = parse_rope(raw, MAX_POS)
    assert rope.rope_type == rope_type
    cos, sin = rope_cos_sin(rope, positions, HEAD_DIM, torch.float32)
    ref_cos, ref_sin = _hf_tables(rope_type, positions)
    # angles of ~300 rad carry an fp32 ulp of 3e-5, so 1e-4 allows rounding, not a wrong formula
    torch.testing.assert_close(cos, ref_cos, atol=1e-4, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=1e-4, rtol=0)
    if rope_type != "default":  # the scaling really changed something
        plain = rope_cos_sin(parse_rope({"rope_theta": 5000.0}, MAX_POS), positions, HEAD_DIM, torch.float32)
        assert (plain[0] - cos).abs().max() > 1e-2


def test_dynamic_uses_each_sequence_length():
    rope = parse_rope({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, MAX_POS)
    positions = torch.tensor([10, 11, 300])
    cos, _ = rope_cos_sin(rope, positions, HEAD_DIM, torch.float32, seq_lens=torch.tensor([12, 12, 301]))
    short, _ = rope_cos_sin(rope, positions[:2], HEAD_DIM, torch.float32)
    long_, _ = rope_cos_sin(rope, positions[2:], HEAD_DIM, torch.float32)
    torch.testing.assert_close(cos, torch.cat([short, long_]))


def test_config_reads_both_spellings(tmp_path):
    base = json.loads((Path(__file__).parents[1] / "models/tiny-qwen3-moe/config.json").read_text())
    base.pop("rope_parameters", None)
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32}
    for key, extra in (("rope_scaling", {"type": "yarn"}), ("rope_parameters", {"rope_type": "yarn"})):
        d = tmp_path / key
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, "rope_theta": 7000.0, key: {**yarn, **extra}}))
        rope = load_model_config(d).rope
        assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings) == (
            "yarn", 7000.0, 4.0, 32)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**base, "rope_scaling": {"type": "longrope", "factor": 2.0}}))
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
        load_model_config(bad)
