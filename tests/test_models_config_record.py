"""load_model_config's record of what it read from transformers' ``AutoConfig``: a later
parse replays it, gives the same config for every family, and imports no transformers
(what each rank's start-up saves); a parse that reads beyond the record parses afresh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elasticep.models import config
from elasticep.models.config import SUPPORTED_FAMILIES, load_model_config
from elasticep_testkit.paths import DEMO_MODEL

REPO = Path(__file__).resolve().parents[1]

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _family_config(family: str, out: Path) -> Path:
    """``out/config.json`` of ``family``'s transformers config class (its own defaults for
    every key left out)."""
    from transformers import AutoConfig

    extra = {"deepseek_v2": dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                 qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                                 moe_intermediate_size=32, num_experts_per_tok=2,
                                 first_k_dense_replace=1),
             "deepseek_v3": dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                 qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                                 moe_intermediate_size=32, n_group=2, topk_group=1)}
    AutoConfig.for_model(family, **SMALL, **extra.get(family, {})).save_pretrained(out)
    return out


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_replay_gives_the_config_transformers_gave(family, tmp_path, monkeypatch):
    model = _family_config(family, tmp_path / family)
    monkeypatch.setenv("ELASTICEP_CONFIG_CACHE", str(tmp_path / "cache"))
    fresh = load_model_config(model)  # nothing recorded yet: transformers parses
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1

    def no_transformers(_cfg):
        raise AssertionError("parsed with transformers again, not replayed")

    monkeypatch.setattr(config, "Recorder", no_transformers)
    assert load_model_config(model) == fresh


def test_a_read_beyond_the_record_parses_afresh(tmp_path, monkeypatch):
    """With generation_config.json's eos, the parse never reads ``AutoConfig``'s
    eos_token_id; once that file is gone it must, and gets transformers' value."""
    model = tmp_path / "m"
    model.mkdir()
    shutil.copy(DEMO_MODEL / "config.json", model / "config.json")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 0]}))
    monkeypatch.setenv("ELASTICEP_CONFIG_CACHE", str(tmp_path / "cache"))
    assert load_model_config(model).eos_token_ids == (7, 0)
    (model / "generation_config.json").unlink()
    replayed = load_model_config(model)
    monkeypatch.setenv("ELASTICEP_CONFIG_CACHE", str(tmp_path / "empty"))
    assert replayed == load_model_config(model)
    assert replayed.eos_token_ids == (json.loads((DEMO_MODEL / "config.json").read_text())
                                      ["eos_token_id"],)


def test_a_recorded_parse_imports_no_transformers(tmp_path):
    code = ("import sys; from elasticep.models.config import load_model_config; "
            f"c = load_model_config({str(DEMO_MODEL)!r}); print(c.num_experts, "
            "'transformers' in sys.modules)")
    env = {"ELASTICEP_CONFIG_CACHE": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, cwd=REPO, env={**os.environ, **env}) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    assert [r.stdout.split() for r in runs] == [["16", "True"], ["16", "False"]]

