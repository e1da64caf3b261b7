"""`elasticep generate` refuses bad flags and prompt files up front, as `serve` does: one
line on stderr, exit status 2, no traceback, no model load and no worker launched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _ckpt_copy import linked_checkpoint

from elasticep.entrypoints.cli import build_parser
from elasticep.entrypoints.generate_cmd import validate
from elasticep.entrypoints.validate import UsageError
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]


def _generate(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "elasticep.entrypoints.cli", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=50, cwd=REPO)


def _assert_refused(run: subprocess.CompletedProcess, message: str) -> None:
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and run.stdout == ""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines == [f"elasticep generate: error: {message}"]


@pytest.mark.parametrize("argv, message", [
    (["--ep-size", "0"], "--ep-size must be >= 1, got 0"),
    (["--ep-size", "4", "--max-ep-size", "2"], "--max-ep-size (2) must be >= --ep-size (4)"),
    (["--model", "/nonexistent/path"],
     "--model /nonexistent/path: no such model directory (config.json not found)"),
    (["--fault", "garbage"], "--fault: fault spec 'garbage': only 'kill' and 'raise' are supported"),
    (["--ep-size", "2", "--log-dir", "/proc/no-such-dir/logs"],
     "--log-dir /proc/no-such-dir/logs: cannot create it (No such file or directory)"),
])
def test_cli_bad_flags_exit_2_with_one_line(argv, message):
    _assert_refused(_generate("--prompt", "hi", "--max-tokens", "4", *argv), message)


def test_cli_unsupported_model_family(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    _assert_refused(_generate("--prompt", "hi", "--model", str(tmp_path)),
                    f"--model {tmp_path}: unsupported model family 'llama' "
                    "(supported: qwen3_moe, qwen2_moe, mixtral, deepseek_v2, deepseek_v3)")


def test_cli_bad_prompts_files(tmp_path):
    missing = tmp_path / "missing.jsonl"
    _assert_refused(_generate("--prompts-file", str(missing)),
                    f"--prompts-file {missing}: no such file")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\nnot json\n')
    _assert_refused(_generate("--prompts-file", str(f)),
                    f"--prompts-file {f}: line 2: not JSON (Expecting value)")


def _validate(*argv: str):
    return validate(build_parser().parse_args(["generate", *argv]))


@pytest.mark.parametrize("argv, message", [
    (["--ep-size", "-2"], "--ep-size must be >= 1, got -2"),
    (["--max-total-tokens", "0"], "--max-total-tokens must be >= 16"),
    (["--max-num-seqs", "0"], "--max-running-requests must be in [1, 65536], got 0"),  # alias
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be >= 1, or -1 (off), got 0"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--elastic-ep-backend", "none", "--ep-size", "2", "--max-ep-size", "3"],
     "--elastic-ep-backend none cannot scale: drop --max-ep-size"),
    (["--ep-size", "2", "--fault", "kill:rank=2:step=3"],
     "--fault: rank 2 is not a rank of this run (--ep-size 2)"),
    (["--fault", "kill:rank=0:step=3"], "--fault kills a worker rank: it needs --ep-size > 1"),
    (["--ep-size", "2", "--fault", "kill:rank=1:step=x"],
     "--fault: fault spec 'kill:rank=1:step=x': step must be an integer"),
])
def test_bad_flags(argv, message):
    with pytest.raises(UsageError) as err:
        _validate("--prompt", "hi", *argv)
    assert str(err.value) == message


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\n\n{"text": "x"}\n',
     'line 3: missing key "prompt" (or "prompt_token_ids"); the object has keys: "text"'),
    ('{"question": "q", "answer": "a"}\n',  # the gsm8k layout
     'line 1: missing key "prompt" (or "prompt_token_ids"); the object has keys: '
     '"question", "answer"'),
    ('{"prompt": 3}\n', 'line 1: "prompt" must be a string, got int'),
    # a lone surrogate: the tokenizer's TypeError ended generate with a traceback
    ('{"prompt": "ok"}\n{"prompt": "a\\ud800"}\n',
     'line 2: "prompt" is not valid Unicode: surrogates not allowed at character 1'),
    ('{"prompt_token_ids": []}\n', 'line 1: "prompt_token_ids" must be a non-empty list of integers'),
    ('["a"]\n', 'line 1: expected a JSON object with a "prompt" or "prompt_token_ids" key, '
     'got a list'),
    ("\n", "no prompts"),
])
def test_bad_prompts_file(tmp_path, content, message):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(UsageError) as err:
        _validate("--prompts-file", str(f))
    assert str(err.value) == f"--prompts-file {f}: {message}"


def test_bad_fault_environment_variable(monkeypatch):
    monkeypatch.setenv("ELASTICEP_FAULT", "oops")
    with pytest.raises(UsageError, match="^ELASTICEP_FAULT: fault spec 'oops'"):
        _validate("--prompt", "hi")


def test_bad_profiler_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTICEP_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("ELASTICEP_TORCH_PROFILER_STEPS", "10")
    with pytest.raises(UsageError, match="^ELASTICEP_TORCH_PROFILER_STEPS must be SKIP:COUNT "
                                         ".* got '10'$"):
        _validate("--prompt", "hi")


def test_valid_flags(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    dep, prompts, params = _validate("--prompts-file", str(f), "--ep-size", "2",
                                     "--fault", "kill:rank=1:step=3", "--max-tokens", "5")
    assert Path(dep.model, "config.json").is_file() and os.path.isabs(dep.model)
    assert (dep.ep_size, dep.max_ep_size, dep.max_running_requests) == (2, 2, None)
    assert prompts == ["a", "b"] and params.max_tokens == 5


def _demo_copy(dst: Path) -> Path:
    """The demo model in ``dst``, files symlinked (the test replaces one)."""
    return linked_checkpoint(DEMO_MODEL, dst)


def test_cli_truncated_or_missing_checkpoint_shard_is_one_error_line(tmp_path):
    """A truncated shard used to end generate with safetensors' traceback (exit 1)."""
    shard = "model-00001-of-00004.safetensors"
    cut = _demo_copy(tmp_path / "cut")
    data = (cut / shard).read_bytes()
    (cut / shard).unlink()
    (cut / shard).write_bytes(data[:len(data) // 2])  # a copy that stopped halfway
    gone = _demo_copy(tmp_path / "gone")
    (gone / shard).unlink()
    for model, message in [
        (cut, f"checkpoint file {cut / shard} is not a readable safetensors file (truncated "
              "or corrupt?): Error while deserializing header: incomplete metadata, file not "
              "fully covered"),
        (gone, f"checkpoint file {gone / shard} is missing"),
    ]:
        run = _generate("--prompt", "hi", "--max-tokens", "2", "--model", str(model))
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert run.stderr.splitlines()[-1] == f"elasticep generate: error: {message}"
        assert run.stdout == ""


def test_prompt_plus_max_tokens_beyond_the_longest_sequence_is_refused_not_cut():
    """generate used to stop such an output at the limit, exit 0, and say nothing."""
    from elasticep.entrypoints.generate_cmd import check_fits

    check_fits([[1] * 6, [1] * 2], 10, 16)  # 6 + 10 fits 16 exactly
    with pytest.raises(UsageError, match=r"^prompt 1: 7 tokens \+ --max-tokens 10 does not "
                                         r"fit the longest sequence, 16 tokens"):
        check_fits([[1] * 6, [1] * 7], 10, 16)
    run = _generate("--prompt", "x", "--max-tokens", "20", "--max-total-tokens", "16")
    assert run.returncode == 2 and run.stdout == "", run.stderr[-2000:]
    assert run.stderr.splitlines()[-1] == (
        "elasticep generate: error: prompt 0: 1 tokens + --max-tokens 20 does not fit the "
        "longest sequence, 16 tokens (the model's context, and the KV cache: "
        "--max-total-tokens)")


@pytest.mark.parametrize("prompt, message", [
    ("", "--prompt must not be empty"),  # was refused only after the model loaded
    ("ab\udcff", "--prompt is not valid Unicode: surrogates not allowed at character 2"),
])
def test_bad_prompt_flag(prompt, message):
    """"\\udcff" is how Python hands over a command-line byte that is not UTF-8 ($'\\xff')."""
    with pytest.raises(UsageError) as err:
        _validate("--prompt", prompt)
    assert str(err.value) == message


@pytest.mark.parametrize("edit, message", [
    (lambda c: [c], "config.json is not a JSON object (a list)"),
    # transformers' own validation error (not a ValueError) ended serve and generate
    # with its traceback, before any rank started
    (lambda c: {**c, "num_experts": "many"}, "config.json: Validation error for field "
     "'num_experts': TypeError: Field 'num_experts' expected int, got str (value: 'many')"),
])
def test_malformed_config_is_one_usage_error(tmp_path, edit, message):
    model = linked_checkpoint(DEMO_MODEL, tmp_path / "m", "config.json", edit)
    with pytest.raises(UsageError) as err:
        _validate("--prompt", "hi", "--model", str(model))
    assert str(err.value) == f"--model {model}: {message}"


def test_index_naming_a_shard_without_the_tensor_is_one_line(tmp_path):
    """The index lists the tensor in a shard that lacks it: safetensors' own error used to
    end a single-rank generate with a traceback (exit 1)."""
    from elasticep.models.checkpoint import CheckpointReader

    key = "model.layers.0.input_layernorm.weight"
    index = "model.safetensors.index.json"
    model = linked_checkpoint(DEMO_MODEL, tmp_path / "m", index, lambda i: {
        **i, "weight_map": {**i["weight_map"], key: "model-00004-of-00004.safetensors"}})
    with CheckpointReader(model) as reader, pytest.raises(ValueError) as err:
        reader.get_stored(key)
    assert str(err.value) == (
        f"tensor {key!r} is not in {model / 'model-00004-of-00004.safetensors'}, where "
        f"{model / index} says it is (supported model families: qwen3_moe, qwen2_moe, "
        "mixtral, deepseek_v2, deepseek_v3)")
