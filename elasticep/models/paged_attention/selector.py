"""Pick a paged-attention implementation per call: torch reference, SDPA, Triton, or flex.

The choice is by device unless a backend is named: SDPA on CPU, Triton on CUDA.
``ELASTICEP_ATTENTION_BACKEND`` (``reference``, ``sdpa``, ``triton``, ``flex``) overrides
the CUDA default so a deployment can switch without code changes. The GPU modules are
imported on first use, so CPU-only installs never import Triton.
"""

from __future__ import annotations

import enum
import os

import torch

from elasticep.models.paged_attention.metadata import PagedAttentionMetadata
from elasticep.models.paged_attention.reference import paged_attention_reference
from elasticep.models.paged_attention.sdpa import paged_attention_sdpa

BACKEND_ENV = "ELASTICEP_ATTENTION_BACKEND"


class AttentionBackend(str, enum.Enum):
    """Implementations of :func:`paged_attention`."""

    REFERENCE = "reference"
    SDPA = "sdpa"
    TRITON = "triton"
    FLEX = "flex"

    @classmethod
    def parse(cls, name: str) -> AttentionBackend:
        """The backend called ``name``; ValueError listing the choices otherwise."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown attention backend {name!r}; choose one of "
                             f"{[b.value for b in cls]}") from None


def default_backend(device: torch.device) -> AttentionBackend:
    """SDPA on CPU; on CUDA ``$ELASTICEP_ATTENTION_BACKEND`` or else Triton."""
    if device.type != "cuda":
        return AttentionBackend.SDPA
    return AttentionBackend.parse(os.environ.get(BACKEND_ENV, AttentionBackend.TRITON.value))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    backend: AttentionBackend | str | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' paged K/V, read in place.

    Args:
        q: ``[T, Hq, D]`` bf16/fp32, RoPE applied; ``Hq = g * Hkv``.
        k_cache, v_cache: ``[num_blocks * block_size, Hkv, D]``, this step's K/V written.
        meta: block tables and lengths on q's device (:class:`PagedAttentionMetadata`).
        scale: softmax scale.
        backend: None picks :func:`default_backend`.

    Returns:
        ``[T, Hq, D]`` in q's dtype (softmax in fp32).

    Raises:
        ValueError: bad shapes/dtypes/devices, or an unknown backend name.
    """
    meta.check(q, k_cache, v_cache)
    chosen = default_backend(q.device) if backend is None else AttentionBackend.parse(backend)
    if chosen is AttentionBackend.TRITON:
        from elasticep.models.paged_attention.triton_kernels import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    if chosen is AttentionBackend.FLEX:
        from elasticep.models.paged_attention.flex import paged_attention_flex

        return paged_attention_flex(q, k_cache, v_cache, meta, scale)
    if chosen is AttentionBackend.SDPA:
        return paged_attention_sdpa(q, k_cache, v_cache, meta, scale)
    return paged_attention_reference(q, k_cache, v_cache, meta, scale)
