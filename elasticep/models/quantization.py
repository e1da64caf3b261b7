"""Which quantized checkpoints we load, and which tensors of a model are quantized.

One format is supported: block-scaled FP8, as DeepSeek-V3/R1 and the Qwen3 ``-FP8``
checkpoints ship it (``config.json``'s ``quantization_config``: ``quant_method: fp8``,
``fmt: e4m3``, ``activation_scheme: dynamic``, ``weight_block_size: [128, 128]``; every
quantized ``<name>`` tensor has a float32 ``<name>_scale_inv`` beside it, see
:mod:`elasticep.moe.experts.fp8_block`). ``--quantization fp8`` (SGLang's and vLLM's flag)
quantizes an unquantized checkpoint to the same format while it loads.

Everything else that declares a ``quantization_config`` (AWQ, GPTQ, compressed-tensors,
bitsandbytes, MXFP4, per-tensor FP8, other block sizes, static activation scales) is
refused with one line: loading weights we cannot interpret would serve garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_block import BLOCK

QUANTIZATION_CHOICES = ("fp8",)
SUPPORTED = ("block-scaled FP8 (quant_method fp8, fmt e4m3, activation_scheme dynamic, "
             "weight_block_size [128, 128]), or an unquantized checkpoint (optionally "
             "quantized while loading with --quantization fp8)")

# Tensors that stay in the checkpoint's dtype whatever the config lists: the router
# gates (and their correction bias), qwen2_moe's shared-expert gate, embeddings, norms
# and the LM head. The reference checkpoints keep exactly these unquantized.
_NEVER_QUANTIZED_SUFFIXES = (
    ".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".shared_expert_gate.weight",
    "embed_tokens.weight", "norm.weight", "lm_head.weight",
)


class UnsupportedQuantizationError(ValueError):
    """A checkpoint's quantization, or a ``--quantization`` value, that we cannot load."""


@dataclass(frozen=True)
class Fp8BlockQuantization:
    """Block-scaled FP8 weights.

    Attributes:
        block: the block shape ``(rows, cols)`` of one scale; (128, 128) is the only one
            the kernels take.
        modules_to_not_convert: module names the checkpoint keeps unquantized (HF's
            ``modules_to_not_convert``; a name matches a module equal to it, or one it
            is a dotted prefix or suffix of).
        online: True when the checkpoint is unquantized and the loader quantizes it
            (``--quantization fp8``, or dummy weights of an FP8 config).
    """

    block: tuple[int, int] = BLOCK
    modules_to_not_convert: tuple[str, ...] = ()
    online: bool = False

    def quantizes(self, key: str, shape: tuple[int, ...]) -> bool:
        """Whether a weight ``key`` of ``shape`` is block-FP8 in this format (what the
        loader quantizes online; a stored checkpoint says so by its ``_scale_inv``)."""
        if len(shape) < 2 or not key.endswith(".weight") or key.endswith(_NEVER_QUANTIZED_SUFFIXES):
            return False
        module = key[: -len(".weight")]
        return not any(module == m or module.startswith(m + ".") or module.endswith("." + m)
                       for m in self.modules_to_not_convert)


def parse_quantization(raw: dict, requested: str | None = None,
                       where: str = "config.json") -> Fp8BlockQuantization | None:
    """The quantization of a checkpoint whose ``config.json`` is ``raw``.

    Args:
        raw: the parsed ``config.json``.
        requested: ``--quantization`` (None, or one of :data:`QUANTIZATION_CHOICES`).
        where: how errors name the file.

    Returns:
        None for an unquantized checkpoint loaded as it is; else the FP8 format
        (``online`` when the loader must quantize it).

    Raises:
        UnsupportedQuantizationError: an unsupported method or FP8 variant, or an
            unknown ``requested`` value; one line naming it and what is supported.
    """
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise UnsupportedQuantizationError(
            f"--quantization {requested!r} is not supported (choose from "
            f"{', '.join(QUANTIZATION_CHOICES)})")
    qc = raw.get("quantization_config")
    if qc is None:
        return Fp8BlockQuantization(online=True) if requested == "fp8" else None
    if not isinstance(qc, dict):
        raise UnsupportedQuantizationError(f"{where}: quantization_config must be an object, "
                                           f"got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method is None:
        raise UnsupportedQuantizationError(
            f"{where}: quantization_config names no quant_method; supported: {SUPPORTED}")
    if method != "fp8":
        raise UnsupportedQuantizationError(
            f"{where}: quantization method {method!r} is not supported; supported: {SUPPORTED}")

    def refuse(what: str) -> UnsupportedQuantizationError:
        return UnsupportedQuantizationError(f"{where}: FP8 with {what} is not supported; "
                                            f"supported: {SUPPORTED}")

    if qc.get("fmt", "e4m3") != "e4m3":
        raise refuse(f"fmt {qc.get('fmt')!r}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse(f"activation_scheme {qc.get('activation_scheme')!r} (static activation scales)")
    block = qc.get("weight_block_size")
    if block is None:
        raise refuse("no weight_block_size (per-tensor scales)")
    if not isinstance(block, list) or list(block) != list(BLOCK):
        raise refuse(f"weight_block_size {block!r}")
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise refuse("a modules_to_not_convert that is not a list of module names")
    return Fp8BlockQuantization(block=tuple(block), modules_to_not_convert=tuple(skip))


def experts_packable(hidden: int, inter: int) -> bool:
    """Whether FP8 experts of this shape stay FP8, packed with their scales in their slots
    (:mod:`elasticep.moe.experts.fp8_block`): the gate/up split falls on a scale block
    (``inter`` a multiple of 128) and both weights pack 4-byte aligned. Other shapes keep
    FP8 experts dequantized (exact, at the bytes of the model dtype)."""
    return (inter % BLOCK[0] == 0 and fp8_block.packable(2 * inter, hidden)
            and fp8_block.packable(hidden, inter))
