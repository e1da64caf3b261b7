"""Token sampling with a counter-based RNG: greedy, temperature, top-k, top-p.

The noise for a draw depends only on (seed, token index) when the request has a seed,
else on (request id, token index). It never depends on batch composition or on how
many draws happened before, so a request resumed elsewhere from prompt + generated
tokens samples exactly the same continuation (DESIGN.md, "One step").
"""

from __future__ import annotations

import hashlib

import torch

from elasticep.engine.request import SamplingParams


def rng_key(request_id: str, seed: int | None, token_index: int) -> int:
    """63-bit generator seed for one draw; a user seed makes draws independent of the id."""
    base = f"seed:{seed}" if seed is not None else f"rid:{request_id}"
    digest = hashlib.blake2b(f"{base}:{token_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to ``logits [V]`` float32; removed tokens -> -inf."""
    x = logits / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always the top token)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        x = x.clone()
        x[order[drop]] = float("-inf")
    return x


def sample_token(logits: torch.Tensor, params: SamplingParams, request_id: str, token_index: int) -> int:
    """Draw one token from ``logits [V]`` (any float dtype, any device).

    Greedy (argmax) when ``params.temperature == 0``; else a Gumbel-max draw whose noise
    comes from :func:`rng_key`.
    """
    logits = logits.float()
    if params.temperature == 0:
        return int(torch.argmax(logits))
    x = filter_logits(logits.cpu(), params)
    gen = torch.Generator().manual_seed(rng_key(request_id, params.seed, token_index))
    u = torch.rand(x.shape, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
    gumbel = -torch.log(-torch.log(u))
    return int(torch.argmax(x.double() + gumbel))


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    request_ids: list[str],
    token_indices: list[int],
) -> list[int]:
    """Sample one token per row of ``logits [B, V]``; pure (no request state is touched)."""
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    out = [0] * len(params)
    if greedy:
        ids = torch.argmax(logits[greedy].float(), dim=-1).tolist()
        for i, t in zip(greedy, ids, strict=True):
            out[i] = t
    for i, p in enumerate(params):
        if p.temperature != 0:
            out[i] = sample_token(logits[i], p, request_ids[i], token_indices[i])
    return out
