"""Block-FP8 checkpoints for the tests, made from an unquantized one (not a test module).

:func:`write_fp8_checkpoint` writes what DeepSeek-V3's and the Qwen3 ``-FP8`` releases
look like: each quantized linear ``<name>`` as float8_e4m3fn beside a float32
``<name>_scale_inv``, the rest as it was, a ``quantization_config`` in ``config.json``,
and sharded safetensors with an index. :func:`write_dequantized` writes the float32
weights such a checkpoint stands for, which transformers loads as a plain model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from elasticep.models.quantization import Fp8BlockQuantization
from elasticep.moe.experts import fp8_block


def read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``model_dir``'s safetensors files."""
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _copy_side_files(src: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    return json.loads((src / "config.json").read_text())


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(out / name))
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))


def fuse_experts(tensors: dict[str, torch.Tensor], num_layers: int,
                 num_experts: int) -> dict[str, torch.Tensor]:
    """The transformers-5 fused expert layout (``mlp.experts.gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``, and their ``_scale_inv`` stacked the same way) of a
    per-expert one."""
    out = dict(tensors)
    for i in range(num_layers):
        p = f"model.layers.{i}.mlp.experts"
        for suffix in ("", "_scale_inv"):
            gate = [out.pop(f"{p}.{e}.gate_proj.weight{suffix}") for e in range(num_experts)]
            up = [out.pop(f"{p}.{e}.up_proj.weight{suffix}") for e in range(num_experts)]
            down = [out.pop(f"{p}.{e}.down_proj.weight{suffix}") for e in range(num_experts)]
            out[f"{p}.gate_up_proj{suffix}"] = torch.stack(
                [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
            out[f"{p}.down_proj{suffix}"] = torch.stack(down)
    return out


def write_fp8_checkpoint(src: Path, out: Path, not_converted: tuple[str, ...] = ("lm_head",),
                         shards: int = 3, fused: bool = False) -> Path:
    """Write ``src`` as a block-FP8 checkpoint into ``out``.

    Args:
        src: an unquantized HF checkpoint directory.
        out: the new directory (created).
        not_converted: ``modules_to_not_convert`` (kept in their dtype).
        shards: safetensors files to split the tensors over.
        fused: write the experts in the fused layout (needs 128-row-aligned gate/up
            halves, so each half's scales stack into the fused tensor's).
    """
    config = _copy_side_files(src, out)
    quant = Fp8BlockQuantization(modules_to_not_convert=not_converted)
    tensors = {}
    for k, w in read_all(src).items():
        if quant.quantizes(k, tuple(w.shape)):
            tensors[k], tensors[k + "_scale_inv"] = fp8_block.quantize(w)
        else:
            tensors[k] = w
    if fused:
        tensors = fuse_experts(tensors, config["num_hidden_layers"], config["num_experts"])
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128], "modules_to_not_convert": list(not_converted)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_sharded(tensors, out, shards)
    return out


def write_dequantized(fp8_dir: Path, out: Path) -> Path:
    """Write the float32 weights the per-expert block-FP8 checkpoint ``fp8_dir`` stands
    for, as a plain checkpoint (no ``quantization_config``) transformers can load."""
    config = _copy_side_files(fp8_dir, out)
    config.pop("quantization_config")
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    stored = read_all(fp8_dir)
    plain = {}
    for k, w in stored.items():
        if k.endswith("_scale_inv"):
            continue
        scale = stored.get(k + "_scale_inv")
        plain[k] = w.float() if scale is None else fp8_block.dequantize(w, scale)
    _save_sharded(plain, out, 1)
    return out
