"""Read a block-FP8 checkpoint (or quantize one while loading) through the reader interface.

:class:`Fp8BlockReader` wraps a :class:`~elasticep.models.checkpoint.CheckpointReader`
or a :class:`~elasticep.models.dummy_weights.DummyWeightReader` and keeps its interface
(``has``, ``get``, ``get_row``, ``get_optional``), so the loader, the orphan reload and a
joining rank read FP8 checkpoints unchanged. A weight ``<name>`` stored as
float8_e4m3fn with ``<name>_scale_inv`` beside it is dequantized exactly
(:func:`elasticep.moe.experts.fp8_block.dequantize`) into the dtype the caller asks for. With
``online`` quantization (``--quantization fp8``, or dummy weights of an FP8 config), each
weight the format quantizes is rounded through block FP8 on the way, so the model holds
what an FP8 checkpoint made from the same weights would hold, bit for bit.
"""

from __future__ import annotations

import torch

from elasticep.models.config import unsupported
from elasticep.models.quantization import Fp8BlockQuantization
from elasticep.moe.experts import fp8_block

SCALE_SUFFIX = "_scale_inv"


class Fp8BlockReader:
    """A weight reader that serves block-FP8 weights dequantized.

    Args:
        inner: the reader of the stored tensors.
        quant: the checkpoint's format (``online``: quantize while reading).

    Raises:
        ValueError: from the getters: an FP8 tensor without its scales, scales of the
            wrong shape, FP8 values of another encoding, or what ``inner`` raises.
    """

    def __init__(self, inner, quant: Fp8BlockQuantization) -> None:
        self.inner = inner
        self.quant = quant

    def __enter__(self) -> Fp8BlockReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the wrapped reader."""
        self.inner.close()

    def has(self, key: str) -> bool:
        """True when the checkpoint holds ``key``."""
        return self.inner.has(key)

    def _stored_fp8(self, key: str) -> bool:
        return not self.quant.online and self.inner.has(key + SCALE_SUFFIX)

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device | str = "cpu") -> torch.Tensor:
        """``key`` as a ``shape`` tensor of ``dtype`` on ``device``, dequantized if it is
        stored as block FP8 (or rounded through it, with online quantization)."""
        if self._stored_fp8(key):
            return self._dequantized(*self._stored(key, shape, None), dtype, device)
        return self._maybe_online(key, self.inner.get(key, shape, torch.float32, device),
                                  dtype)

    def get_row(self, key: str, row: int, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device | str = "cpu") -> torch.Tensor:
        """Row ``row`` of a stacked (fused-expert) tensor; its scales are the same row of
        ``<key>_scale_inv``."""
        if self._stored_fp8(key):
            return self._dequantized(*self._stored(key, shape, row), dtype, device)
        return self._maybe_online(key, self.inner.get_row(key, row, shape, torch.float32, device),
                                  dtype)

    def get_optional(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device | str) -> torch.Tensor | None:
        """Like :meth:`get`, but None when the key is absent."""
        return self.get(key, shape, dtype, device) if self.has(key) else None

    def expert_fp8(self, key: str) -> bool:
        """Whether expert weight ``key`` is FP8 in this checkpoint (stored with its
        scales, or quantized while loading): such experts are kept packed with their
        scales (:func:`get_fp8`), not dequantized."""
        return self.quant.online or self.inner.has(key + SCALE_SUFFIX)

    def is_fp8(self, key: str, shape: tuple[int, ...]) -> bool:
        """Whether weight ``key`` of ``shape`` is block FP8 here: stored with its scales,
        or (online) one the format quantizes. Such a dense projection is kept FP8
        (:func:`get_fp8`)."""
        if self.quant.online:
            return self.quant.quantizes(key, shape)
        return self.inner.has(key + SCALE_SUFFIX)

    def get_fp8(self, key: str, shape: tuple[int, int], device: torch.device | str,
                row: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``key`` (or row ``row`` of a stacked one) as block FP8: ``(q [shape]
        float8_e4m3fn, scale_inv [ceil(shape / 128)] float32)`` on ``device``, as stored,
        or quantized now (online).

        Raises:
            ValueError: missing tensor, wrong shape or dtype, scales of the wrong shape.
        """
        if self._stored_fp8(key):
            q, scale = self._stored(key, shape, row)
            return q.to(device), scale.float().to(device)
        w = (self.inner.get(key, shape, torch.float32, device) if row is None
             else self.inner.get_row(key, row, shape, torch.float32, device))
        return fp8_block.quantize(w, self.quant.block)

    def _maybe_online(self, key: str, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.quant.online and self.quant.quantizes(key, tuple(w.shape)):
            return fp8_block.fake_quantize(w, dtype, self.quant.block)
        return w.to(dtype)

    def _stored(self, key: str, shape: tuple[int, ...],
                row: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``key`` (or its row ``row``) and its scales as stored, checked: the shape, the
        FP8 encoding and the scales' dtype and shape."""
        if row is None:
            q, scale = self.inner.get_stored(key), self.inner.get_stored(key + SCALE_SUFFIX)
        else:
            q = self.inner.get_row_stored(key, row)
            scale = self.inner.get_row_stored(key + SCALE_SUFFIX, row)
        if tuple(q.shape) != tuple(shape):
            raise unsupported(f"tensor {key!r} has shape {list(q.shape)}, expected {list(shape)}")
        if q.dtype != fp8_block.FP8_DTYPE:
            raise ValueError(f"tensor {key!r} has block scales but is stored as "
                             f"{str(q.dtype).removeprefix('torch.')}, not float8_e4m3fn")
        if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"scales {key + SCALE_SUFFIX!r} are {scale.dtype}, not float32")
        want = fp8_block.scale_shape(q.shape, self.quant.block)
        if tuple(scale.shape) != want:
            raise ValueError(f"tensor {key!r}: block scales of a {list(q.shape)} weight must "
                             f"be {list(want)} for {self.quant.block[0]}x{self.quant.block[1]} "
                             f"blocks, got {list(scale.shape)}")
        return q, scale

    def _dequantized(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                     device: torch.device | str) -> torch.Tensor:
        return fp8_block.dequantize(q.to(device), scale.to(device), torch.float32,
                                    self.quant.block).to(dtype)
