"""Paged attention over the flat KV cache: a torch reference, SDPA (the CPU path), Triton
kernels, flex_attention.

All implementations take ``(q, k_cache, v_cache, meta, scale)`` with ``meta`` a
:class:`PagedAttentionMetadata` built once per step; the
selector's :func:`paged_attention` picks one per device or by name.
"""

from elasticep.models.paged_attention.metadata import PagedAttentionMetadata
from elasticep.models.paged_attention.reference import paged_attention_reference
from elasticep.models.paged_attention.sdpa import paged_attention_sdpa
from elasticep.models.paged_attention.selector import (
    BACKEND_ENV,
    AttentionBackend,
    default_backend,
    paged_attention,
)

__all__ = ["BACKEND_ENV", "AttentionBackend", "PagedAttentionMetadata", "default_backend",
           "paged_attention", "paged_attention_reference", "paged_attention_sdpa"]
