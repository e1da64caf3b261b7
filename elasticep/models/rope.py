"""Rotary position embeddings with the scaling schemes HF checkpoints declare.

One :class:`RopeConfig` is parsed from a ``config.json`` (``rope_parameters`` in
transformers 5, ``rope_scaling`` plus ``rope_theta`` before), and :func:`rope_cos_sin`
turns absolute positions into the cos/sin tables the attention layers apply. The
frequency formulas follow transformers' ``modeling_rope_utils`` (default, linear,
dynamic NTK, YaRN from arXiv:2309.00071, Llama 3.1), so the tables match theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """The RoPE variant of a checkpoint and its parameters.

    Attributes:
        rope_type: one of :data:`SUPPORTED_ROPE_TYPES`.
        theta: the base wavelength.
        factor: context extension factor (1.0 for ``default``).
        max_position_embeddings: the config's (extended) context length; dynamic NTK
            starts scaling past it.
        original_max_position_embeddings: the pretraining context length (YaRN, llama3).
        attention_factor: YaRN's multiplier on cos and sin (1.0 for the other types).
        beta_fast, beta_slow: YaRN's ramp bounds, in rotations.
        truncate: YaRN rounds the ramp bounds to whole dimensions.
        low_freq_factor, high_freq_factor: Llama 3.1's band edges.
        mscale_all_dim: DeepSeek's YaRN softmax-scale exponent (0 = none).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    max_position_embeddings: int = 2048
    original_max_position_embeddings: int = 2048
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    mscale_all_dim: float = 0.0

    @property
    def softmax_mscale(self) -> float:
        """Extra factor on the attention softmax scale, ``yarn_get_mscale(factor, mscale_all_dim) ** 2``.

        DeepSeek-V2/V3 (MLA) multiply ``qk_head_dim ** -0.5`` by it whenever the rope type
        is not ``default`` and ``mscale_all_dim`` is set (transformers' ``yarn_apply_mscale``).
        """
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def parse_rope(raw: dict, max_position_embeddings: int) -> RopeConfig:
    """Read the RoPE settings of a raw ``config.json`` dict.

    ``rope_parameters`` (transformers 5) wins over ``rope_scaling`` (older configs and
    the original DeepSeek ones); the type key is ``rope_type`` or ``type``; theta comes
    from the dict or the top-level ``rope_theta`` (default 10000, as transformers).

    Raises:
        ValueError: an unsupported rope type, a missing ``factor``, or
            ``partial_rotary_factor`` != 1 (we rotate whole heads).
    """
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    original = int(params.get("original_max_position_embeddings")
                   or raw.get("original_max_position_embeddings") or max_position_embeddings)
    factor = params.get("factor")
    if factor is None:
        if rope_type == "yarn":  # transformers' fallback for DeepSeek-style configs
            factor = max_position_embeddings / original
        elif rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
        else:
            factor = 1.0
    factor = float(factor)
    attention_factor = 1.0
    if rope_type == "yarn":
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            else:
                attention_factor = _yarn_mscale(factor)
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=factor,
        max_position_embeddings=int(max_position_embeddings),
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    )


def _base_inv_freq(base: float | torch.Tensor, dim: int, device: torch.device) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (base ** exponent)


def _yarn_inv_freq(rope: RopeConfig, dim: int, device: torch.device) -> torch.Tensor:
    """Blend interpolated and extrapolated frequencies over a linear ramp (YaRN, sec. 3.2)."""

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength completes ``rotations`` turns over the original context
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    # built on the device: a host tensor copied in would break a CUDA graph capture
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low)
            / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolate = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def _llama3_inv_freq(rope: RopeConfig, dim: int, device: torch.device) -> torch.Tensor:
    """Divide low frequencies by ``factor``, keep high ones, interpolate the band between."""
    inv_freq = _base_inv_freq(rope.theta, dim, device)
    old_len = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_freq(rope: RopeConfig, dim: int, device: torch.device | str = "cpu",
             seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies of a ``dim``-wide rotary embedding.

    Args:
        seq_lens: ``[T]`` int64 sequence length per token; only dynamic NTK uses it
            (its base grows with the sequence past ``max_position_embeddings``).

    Returns:
        ``[dim // 2]`` float32, or ``[T, dim // 2]`` for dynamic NTK given ``seq_lens``.
    """
    device = torch.device(device)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim, device)
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, dim, device)
    if rope.rope_type == "dynamic" and seq_lens is not None:
        mpe = rope.max_position_embeddings
        length = torch.clamp(seq_lens.to(device), min=mpe).float()
        base = rope.theta * ((rope.factor * length / mpe) - (rope.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base[:, None], dim, device)
    freqs = _base_inv_freq(rope.theta, dim, device)
    return freqs / rope.factor if rope.rope_type == "linear" else freqs


def rope_cos_sin(rope: RopeConfig, positions: torch.Tensor, dim: int, dtype: torch.dtype,
                 seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables for ``positions``, in the half-split layout of :func:`apply_rope`.

    Args:
        positions: ``[T]`` int64 absolute positions.
        dim: rotated width (head_dim, or qk_rope_head_dim for MLA).
        dtype: output dtype (the tables are computed in float32 and cast, as transformers).
        seq_lens: ``[T]`` length of each token's sequence after this step (dynamic NTK only;
            None = ``max(positions) + 1`` for every token, transformers' single-batch rule).

    Returns:
        cos, sin ``[T, dim]`` in ``dtype``, each scaled by YaRN's attention factor.
    """
    if rope.rope_type == "dynamic" and seq_lens is None and positions.numel():
        seq_lens = (positions.max() + 1).expand(positions.shape[0])
    freq = inv_freq(rope, dim, positions.device, seq_lens)
    angles = positions.float()[:, None] * freq
    emb = torch.cat((angles, angles), dim=-1)
    return (emb.cos() * rope.attention_factor).to(dtype), (emb.sin() * rope.attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by the half-split convention (cos/sin ``[T, D]``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def deinterleave_rows(weight: torch.Tensor, num_heads: int, head_dim: int, rope_start: int) -> torch.Tensor:
    """Reorder the rotary rows of a projection from interleaved pairs to half-split.

    DeepSeek checkpoints rotate pairs ``(x0, x1), (x2, x3), ...``; permuting the output
    rows that feed the rotary part to ``(x0, x2, ..., x1, x3, ...)`` once at load time lets
    :func:`apply_rope` serve them. q and k get the same permutation, so q.k is unchanged.

    Args:
        weight: ``[num_heads * head_dim, in]`` (or a bias ``[num_heads * head_dim]``).
        rope_start: offset of the rotary part inside each head's ``head_dim`` rows.

    Returns:
        A new tensor of ``weight``'s shape.
    """
    rows = weight.view(num_heads, head_dim, *weight.shape[1:])
    rot = rows[:, rope_start:]
    order = torch.cat((torch.arange(0, rot.shape[1], 2), torch.arange(1, rot.shape[1], 2)))
    return torch.cat((rows[:, :rope_start], rot[:, order.to(weight.device)]), dim=1).reshape(weight.shape)
