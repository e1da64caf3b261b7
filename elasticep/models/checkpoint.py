"""Read tensors by name from a safetensors checkpoint (single file or sharded index).

Tensors are read one key at a time (``safe_open`` + ``get_tensor`` / ``get_slice``), so
peak memory stays near what the caller keeps. Every failure is a one-line ValueError
that names the problem and the supported families.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from elasticep.models.config import unsupported


class CheckpointReader:
    """Name -> tensor access over ``model_dir``'s ``*.safetensors``.

    Use as a context manager; shard files are opened lazily and closed on exit.

    Raises:
        ValueError: no safetensors files, a missing tensor, or a wrong shape.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{index}: not a safetensors index (a JSON object with a "
                                 f"'weight_map'): {exc!r}") from None
            self.key_to_file = {k: self.model_dir / f for k, f in weight_map.items()}
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise unsupported(f"no *.safetensors files in {self.model_dir}")
            self.key_to_file = {}
            for f in files:
                handle = _open(f)
                try:
                    for k in handle.keys():
                        self.key_to_file[k] = f
                finally:
                    handle.__exit__(None, None, None)
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every opened shard."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def has(self, key: str) -> bool:
        """True when the checkpoint holds ``key``."""
        return key in self.key_to_file

    def _handle(self, key: str) -> Any:
        if key not in self.key_to_file:
            raise unsupported(f"missing tensor {key!r} in checkpoint {self.model_dir}")
        path = self.key_to_file[key]
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def get(
        self,
        key: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Read ``key``, check it is ``shape`` and convert it to ``dtype`` on ``device``.

        Raises:
            ValueError: also for a tensor stored quantized (FP8, or integers where a
                float weight belongs): converting its raw values would be garbage; the
                FP8 reader (:mod:`elasticep.models.fp8_reader`) reads those.
        """
        tensor = self.get_stored(key)
        _check_shape(key, tuple(tensor.shape), shape)
        _check_plain(key, tensor.dtype, self.model_dir)
        return tensor.to(device=device, dtype=dtype)

    def get_stored(self, key: str) -> torch.Tensor:
        """``key`` as stored: its own dtype, on the CPU, no shape check."""
        handle = self._handle(key)
        try:
            return handle.get_tensor(key)
        except SafetensorError:
            raise self._not_in_shard(key) from None

    def _not_in_shard(self, key: str) -> ValueError:
        """The index sends ``key`` to a shard that does not hold it (an index left from
        another save, or a shard replaced); safetensors' own error is a bare traceback."""
        return unsupported(f"tensor {key!r} is not in {self.key_to_file[key]}, where "
                           f"{self.model_dir / 'model.safetensors.index.json'} says it is")

    def get_row_stored(self, key: str, row: int) -> torch.Tensor:
        """``key[row]`` of a stacked tensor as stored (its own dtype, on the CPU).

        Raises:
            ValueError: ``row`` is outside the stack.
        """
        handle = self._handle(key)
        try:
            sl = handle.get_slice(key)
        except SafetensorError:
            raise self._not_in_shard(key) from None
        n = sl.get_shape()[0]
        if not 0 <= row < n:
            raise unsupported(f"tensor {key!r} has {n} experts, expert {row} requested")
        return sl[row]

    def get_row(
        self,
        key: str,
        row: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Read only ``key[row]`` of a stacked tensor (fused expert layout)."""
        tensor = self.get_row_stored(key, row)
        _check_shape(key, tuple(tensor.shape), shape)
        _check_plain(key, tensor.dtype, self.model_dir)
        return tensor.to(device=device, dtype=dtype)

    def get_optional(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor | None:
        """Like :meth:`get`, but None when the key is absent."""
        return self.get(key, shape, dtype, device) if self.has(key) else None


def _open(path: Path) -> Any:
    """An open ``safe_open`` handle of one shard (the caller closes it).

    Raises:
        ValueError: the file is missing, unreadable, or not safetensors (truncated by a
            copy, say): one line naming the file, not safetensors' traceback.
    """
    try:
        return safe_open(str(path), framework="pt").__enter__()
    except FileNotFoundError:
        raise ValueError(f"checkpoint file {path} is missing") from None
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"checkpoint file {path} is not a readable safetensors file "
                         f"(truncated or corrupt?): {exc}") from None


_PLAIN_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_plain(key: str, dtype: torch.dtype, model_dir: Path) -> None:
    """Refuse to convert a tensor stored quantized as if it were a plain float weight."""
    if dtype not in _PLAIN_DTYPES:
        raise ValueError(
            f"tensor {key!r} in {model_dir} is stored as {str(dtype).removeprefix('torch.')}, "
            f"which is not a plain float weight, and is read as one: its block scales "
            f"{key + '_scale_inv'!r} are missing, or config.json declares no quantization "
            "(supported: block-scaled FP8 with its '<name>_scale_inv' scales)")


def _check_shape(key: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise unsupported(f"tensor {key!r} has shape {list(got)}, expected {list(want)}")


# Storage dtypes (safetensors header names) of quantized formats: FP8, int8, and the
# int32/uint8 words that GPTQ/AWQ/bitsandbytes pack 4-bit values into.
_QUANTIZED_STORAGE = ("F8_E4M3", "F8_E5M2", "I8", "U8", "I32")


def first_quantized_tensor(model_dir: str | Path) -> tuple[str, str] | None:
    """The first tensor (name, safetensors dtype) of ``model_dir`` stored in a quantized
    dtype (:data:`_QUANTIZED_STORAGE`), or None; reads only each shard's header (dtypes
    through ``get_slice``, no tensor data), so it is cheap for any checkpoint size. A
    directory without shards, or a shard that cannot be opened, gives None: the loader
    reports those itself.
    """
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            handle = _open(f)
        except ValueError:
            continue
        try:
            for key in handle.keys():
                dtype = handle.get_slice(key).get_dtype()
                if dtype in _QUANTIZED_STORAGE:
                    return key, dtype
        finally:
            handle.__exit__(None, None, None)
    return None
