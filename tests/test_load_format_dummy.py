"""``--load-format dummy``: weights from a seed, the same expert whatever slot or rank holds it.

The model directory holds only the demo model's config.json (no weights, no tokenizer),
as a user benchmarking a real shape would have.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elasticep.models import load_model, reload_expert
from elasticep.models.weight_source import open_weights
from elasticep_testkit.paths import DEMO_MODEL

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 300, 12], [900, 1, 2, 3, 4, 5], [4000, 4001], [77] * 9]
MAX_TOKENS = 12

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dummy-model")
    shutil.copy(DEMO_MODEL / "config.json", d / "config.json")
    return d


def _generate(model: Path, tmp: Path, *extra: str, prompts=PROMPTS) -> subprocess.CompletedProcess:
    f = tmp / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    cmd = [sys.executable, "-m", "elasticep.entrypoints.cli", "generate", "--model", str(model),
           "--load-format", "dummy", "--prompts-file", str(f), "--max-tokens", str(MAX_TOKENS),
           *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO)


def _tokens(run: subprocess.CompletedProcess) -> list[list[int]]:
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["index"] for r in rows] == list(range(len(PROMPTS)))
    return [r["token_ids"] for r in rows]


def test_values_depend_on_name_and_seed_only(config_only):
    with open_weights(config_only, "dummy") as a, open_weights(config_only, "dummy") as b:
        key = "model.layers.2.mlp.experts.5.up_proj.weight"
        x = a.get(key, (256, 256), torch.float32)
        assert torch.equal(x, b.get(key, (256, 256), torch.float32))
        other = a.get("model.layers.3.mlp.experts.5.up_proj.weight", (256, 256), torch.float32)
        assert not torch.equal(x, other)
        assert 0.015 < float(x.std()) < 0.025  # the config's initializer_range, 0.02
        assert torch.equal(a.get("model.norm.weight", (256,), torch.float32), torch.ones(256))
        assert not a.has("lm_head.bias") and a.has("lm_head.weight")
        with pytest.raises(ValueError, match="missing tensor"):
            a.get("model.layers.99.mlp.gate.weight", (16, 256), torch.float32)
    with open_weights(config_only, "dummy", seed=1) as c:
        assert not torch.equal(x, c.get(key, (256, 256), torch.float32))


def test_expert_is_the_same_in_any_slot(config_only):
    """A rank holding experts [3, 9] in slots [0, 1] has the EP1 model's experts 3 and 9,
    and an orphan reload into another slot draws the same values again."""
    full = load_model(config_only, load_format="dummy", progress=False)
    L = full.config.num_hidden_layers
    part = load_model(config_only, load_format="dummy", progress=False,
                      slot_to_logical=torch.tensor([[3, 9]] * L))
    for layer in range(L):
        assert torch.equal(part.experts.w13[layer][0], full.experts.w13[layer][3])
        assert torch.equal(part.experts.w2[layer][1], full.experts.w2[layer][9])
    reload_expert(part, config_only, layer=1, slot=0, logical_expert=9, load_format="dummy")
    assert torch.equal(part.experts.w13[1][0], full.experts.w13[1][9])


def test_generate_ep1_ep2_and_a_killed_rank_agree(config_only, tmp_path):
    """EP1, EP2 and EP2 with rank 1 SIGKILLed at step 4 (no redundant experts, so the
    survivor reloads the dead rank's experts from the seed) give the same greedy tokens.
    The random model's top-2 logit margins are far above fp32 noise (it is not a near
    tie), so equality is exact."""
    ep1 = _tokens(_generate(config_only, tmp_path))
    assert len({tuple(t) for t in ep1}) == len(PROMPTS)  # a collapsed model would repeat
    assert all(len(t) == MAX_TOKENS for t in ep1)  # no eos in the dummy config's way
    ep2 = _tokens(_generate(config_only, tmp_path, "--ep-size", "2"))
    assert ep2 == ep1
    killed = _generate(config_only, tmp_path, "--ep-size", "2", "--fault", "kill:rank=1:step=4")
    assert _tokens(killed) == ep1
    assert "rank 1" in killed.stderr and "dead" in killed.stderr


def test_text_prompt_without_tokenizer_is_a_clear_error(config_only, tmp_path):
    cmd = [sys.executable, "-m", "elasticep.entrypoints.cli", "generate", "--model",
           str(config_only), "--load-format", "dummy", "--prompt", "hello", "--max-tokens", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2
    assert "has no tokenizer: send the prompt as token ids" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_config_only_directory_is_refused_at_start_with_the_fix(config_only, tmp_path):
    """generate and serve refuse a directory with only config.json unless --load-format
    dummy: exit 2, one line that names the flag (the rank used to die reading weights)."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n")
    for cmd in (["generate", "--prompts-file", str(tmp_path / "p.jsonl"), "--max-tokens", "2"],
                ["serve", "--port", "0"]):
        run = subprocess.run(
            [sys.executable, "-m", "elasticep.entrypoints.cli", *cmd, "--model",
             str(config_only)], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert run.returncode == 2, run.stderr
        (line,) = run.stderr.strip().splitlines()
        assert "no *.safetensors files" in line and "add --load-format dummy" in line, line
    from elasticep.entrypoints.validate import check_model_dir

    # with the flag the directory passes (the other tests here run it)
    assert check_model_dir(str(config_only), "dummy") == str(config_only.resolve())


def test_relaunched_rank_draws_the_same_experts(config_only):
    """EP2 with dummy weights: kill rank 1, relaunch it (join mode "recover": its experts
    come from peers or the seed), and the next batch, half of which the relaunched rank
    serves, still equals EP1's tokens."""
    from elasticep.config import DeploymentConfig
    from elasticep.engine.llm_engine import LLMEngine
    from elasticep.engine.request import SamplingParams
    from elasticep.entrypoints.batch_driver import BatchDriver

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ep1 = LLMEngine.from_pretrained(config_only, load_format="dummy", progress=False)
    want = ep1.generate(PROMPTS, params)
    cfg = DeploymentConfig(model=str(config_only), ep_size=2, max_ep_size=2,
                           load_format="dummy", heartbeat_timeout_s=2.0)
    with BatchDriver.launch(cfg, lambda ids: "") as driver:
        assert [c.token_ids for c in driver.generate(PROMPTS, params, timeout_s=120)] == want
        dep = driver.deployment
        dep.kill(1)
        dep.wait_healthy([0], timeout_s=60)
        dep.relaunch(1)
        dep.wait_healthy([0, 1], timeout_s=120)
        driver.wait_routable([0, 1], timeout_s=60)
        outs = driver.generate(PROMPTS, params, timeout_s=120)
    assert [c.error for c in outs] == [None] * len(PROMPTS)
    assert [c.token_ids for c in outs] == want
