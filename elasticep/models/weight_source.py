"""Where a rank's weights come from: the reader for a checkpoint directory and a
``--load-format`` (safetensors, or dummy weights drawn from a seed), wrapped in the
block-FP8 reader for an FP8 checkpoint or ``--quantization fp8``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from elasticep.config import LoadFormat
from elasticep.models.checkpoint import CheckpointReader
from elasticep.models.config import MoEModelConfig, load_model_config
from elasticep.models.dummy_weights import DEFAULT_STD, DummyWeightReader
from elasticep.models.fp8_reader import Fp8BlockReader
from elasticep.models.quantization import parse_quantization

# vLLM's names: "auto" and "safetensors" read the checkpoint; "dummy" draws from a seed.
LOAD_FORMATS = tuple(f.value for f in LoadFormat)

WeightReader = CheckpointReader | DummyWeightReader | Fp8BlockReader


def open_weights(model_dir: str | Path, load_format: str = "auto", seed: int = 0,
                 config: MoEModelConfig | None = None,
                 quantization: str | None = None) -> WeightReader:
    """The weight reader of ``model_dir`` for ``load_format`` (use it as a context manager).

    Args:
        model_dir: checkpoint directory; for "dummy" only ``config.json`` is read.
        load_format: one of :data:`LOAD_FORMATS`.
        seed: the dummy weights' seed (ignored otherwise).
        config: the parsed config, if the caller has it.
        quantization: ``--quantization`` (None or "fp8": quantize an unquantized
            checkpoint to block FP8 while reading).

    Returns:
        A reader; for a block-FP8 checkpoint (or with ``quantization``) an
        :class:`~elasticep.models.fp8_reader.Fp8BlockReader` that dequantizes exactly.

    Raises:
        ValueError: unknown format, or what the reader raises (no safetensors, bad config);
            :class:`~elasticep.models.quantization.UnsupportedQuantizationError` for a
            quantization we cannot read.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose from {', '.join(LOAD_FORMATS)}")
    cfg = config or load_model_config(model_dir)
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    quant = parse_quantization(raw, quantization, str(Path(model_dir) / "config.json"))
    reader: WeightReader
    if load_format in ("auto", "safetensors"):
        reader = CheckpointReader(model_dir)
    else:
        reader = DummyWeightReader(model_dir, cfg, seed=seed,
                                   std=float(raw.get("initializer_range") or DEFAULT_STD))
        if quant is not None:  # drawn weights are unquantized: round them through FP8
            quant = replace(quant, online=True)
    return reader if quant is None else Fp8BlockReader(reader, quant)
