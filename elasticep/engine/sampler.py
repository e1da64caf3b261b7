"""Token sampling on the logits' device: greedy, temperature, top-k, top-p, seeded.

One call samples the whole batch with tensor ops (no Python loop over rows for the
math) and moves the chosen ids to the host once. Sampling is Gumbel-max over the
filtered logits: ``argmax(x / T + G)`` with ``G = -log(-log(u))`` draws from
``softmax(x / T)`` (Gumbel 1954; the "Gumbel-max trick", Maddison et al. 2014).

The uniform ``u`` for a (row, vocab index) comes from a counter-based generator: the
row's 63-bit key :func:`rng_key` (seed and token index when the request has a seed,
else request id and token index) is the seed of a splitmix64 sequence (Steele, Lea
and Flood 2014) and the vocab index is its counter. Only integer ops make the bits,
so CPU and CUDA give identical noise, and a row's draws depend on nothing else in the
batch: a request resumed elsewhere from prompt + generated tokens samples exactly the
same continuation (DESIGN.md, "One step").

Every value :meth:`SamplingParams.validate` accepts is computable here: each row is
shifted so that its top logit is 0 before the temperature divides it, so a tiny
temperature sends the other tokens to -inf instead of overflowing to inf (``inf - inf``
made NaNs, and a NaN argmax picked token 0); top-p always keeps the top token, even
for a ``top_p`` that rounds to 0 in float32; a ``top_k`` beyond int64 counts as
"disabled". A row whose sampling still raises fails alone (:class:`SamplingFailure`),
so one request's values never take the batch, or the rank, down with it.

Penalties, ``logit_bias``, ``min_tokens`` and ``min_p`` (:mod:`logits_processing`) run
here too. The sampler is never inside a captured CUDA graph: a decode graph's replay
returns the logits and this module samples them eagerly, so every parameter holds on
the graph path exactly as on the eager one.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from elasticep.engine.logits_processing import min_p_filter, process_logits
from elasticep.engine.request import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingFailure:
    """The sampled "token" of a row whose sampling raised: the request fails, not the step.

    Attributes:
        message: the exception, as ``Type: text``.
    """

    message: str


def _i64(c: int) -> int:
    """A 64-bit constant as the signed int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


# splitmix64's increment and finalizer multipliers
_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def rng_key(request_id: str, seed: int | None, token_index: int) -> int:
    """63-bit key of one draw; a user seed makes draws independent of the id."""
    base = f"seed:{seed}" if seed is not None else f"rid:{request_id}"
    digest = hashlib.blake2b(f"{base}:{token_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` sign-extends)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1) for every (row key, vocab index), bit-identical on CPU and CUDA.

    Element ``[r, v]`` is output ``v + 1`` of splitmix64 seeded with ``keys[r]``: state
    ``key + (v + 1) * golden`` through the splitmix64 finalizer, all mod 2**64 in int64
    ops (multiplication wraps), then the top 52 bits as ``(bits + 0.5) / 2**52`` (exact
    in float64, so never rounded up to 1).

    Args:
        keys: ``[R]`` int64 row keys (from :func:`rng_key`), on the output device.
        vocab_size: ``V``.

    Returns:
        ``[R, V]`` float64, never exactly 0 or 1.
    """
    counter = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device)
    z = keys[:, None] + counter[None, :] * _GOLDEN
    z ^= _shr(z, 30)
    z *= _MIX1
    z ^= _shr(z, 27)
    z *= _MIX2
    z ^= _shr(z, 31)
    return (_shr(z, 12).double() + 0.5) * 2.0**-52


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    max_top_k: int,
    any_top_p: bool,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scale by temperature and mask what min-p, then top-k, then top-p remove (to -inf),
    in vLLM's order.

    Top-p keeps the smallest set of most likely tokens whose mass (after top-k) reaches
    ``top_p``, always the top token; ties at a threshold are all kept.

    Args:
        logits: ``[R, V]`` any float dtype.
        temperature: ``[R]`` float32, > 0.
        top_k: ``[R]`` int64, 0 (or >= V) disables.
        top_p: ``[R]`` float32 in (0, 1]; 1 disables.
        max_top_k: host int, the largest enabled ``top_k`` (0 if none), so that no
            device value is read on the host.
        any_top_p: host bool, some row has ``top_p < 1``.
        min_p: ``[R]`` float32 in [0, 1] (0 disables), or None when no row sets it.

    Returns:
        ``[R, V]`` float32, at most 0 (each row's top logit maps to 0).
    """
    x = logits.float()
    # the top logit goes to 0 first, so x / T is finite or -inf for every T > 0
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature[:, None]
    if min_p is not None:
        x = min_p_filter(x, min_p)
    V = x.shape[1]
    use_top_k = 0 < max_top_k < V
    if any_top_p:
        ranked = torch.sort(x, dim=-1, descending=True).values
    elif use_top_k:
        ranked = torch.topk(x, max_top_k, dim=-1).values
    else:
        return x
    if use_top_k:
        on = (top_k > 0) & (top_k < V)
        pick = (torch.where(on, top_k, 1) - 1).clamp(max=ranked.shape[1] - 1)
        kth = torch.where(on, ranked.gather(1, pick[:, None]).squeeze(1), float("-inf"))
        x = x.masked_fill(x < kth[:, None], float("-inf"))
        ranked = ranked.masked_fill(ranked < kth[:, None], float("-inf"))
    if any_top_p:
        probs = torch.softmax(ranked, dim=-1)
        mass_before = probs.cumsum(-1) - probs
        keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        # keep is a prefix; it holds the top token unless top_p rounded to 0 in float32
        last = (keep.sum(-1, keepdim=True) - 1).clamp(min=0)
        x = x.masked_fill(x < ranked.gather(1, last), float("-inf"))
    return x


def _check_rows(logits: torch.Tensor, *per_row: Sequence[object]) -> int:
    """The batch size ``B``; raises ValueError unless every per-row list has ``B`` items."""
    B = logits.shape[0]
    params, request_ids, token_indices = per_row
    if not len(params) == len(request_ids) == len(token_indices) == B:
        raise ValueError(f"{B} logit rows but {len(params)} params, {len(request_ids)} request ids "
                         f"and {len(token_indices)} token indices")
    return B


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to ``device`` without blocking the host on CUDA (pinned, async)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(frozen=True)
class RowTokens:
    """What the logits processors of one batch read besides the params.

    Attributes:
        prompts: ``[B]`` each row's prompt token ids.
        outputs: ``[B]`` each row's output token ids so far.
        eos_ids: the model's EOS token ids.
    """

    prompts: Sequence[Sequence[int]]
    outputs: Sequence[Sequence[int]]
    eos_ids: Collection[int] = ()

    def rows(self, i: int, j: int) -> RowTokens:
        """Rows ``i:j`` only."""
        return RowTokens(self.prompts[i:j], self.outputs[i:j], self.eos_ids)


def sample_batch_tensor(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    request_ids: Sequence[str],
    token_indices: Sequence[int],
    tokens: RowTokens | None = None,
) -> torch.Tensor:
    """Sample one token per row of ``logits [B, V]`` on its device; pure, no host sync.

    Rows with penalties, a logit bias or ``min_tokens`` first go through
    :func:`~elasticep.engine.logits_processing.process_logits`. Greedy rows
    (``temperature == 0``) then take the argmax (first index on ties); the others a
    Gumbel-max draw over :func:`filter_logits`, keyed by :func:`rng_key`.

    Args:
        logits: ``[B, V]`` any float dtype, any device.
        params, request_ids, token_indices: per row; ``token_indices[i]`` is the index
            among the request's outputs of the token being drawn.
        tokens: the rows' prompt and output tokens; needed only when a row's params
            need processing.

    Returns:
        ``[B]`` int64 token ids on ``logits.device``.

    Raises:
        ValueError: the per-row lists do not match the batch size, or a row needs
            processing and ``tokens`` is None.
    """
    _check_rows(logits, params, request_ids, token_indices)
    if any(p.needs_processing for p in params):
        if tokens is None:
            raise ValueError("penalties, logit_bias and min_tokens need the rows' tokens")
        logits = process_logits(logits, params, tokens.prompts, tokens.outputs, tokens.eos_ids)
    ids = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature != 0]
    if not rows:
        return ids
    dev = logits.device
    V = logits.shape[1]
    sampled = [params[i] for i in rows]
    ints = torch.tensor([rows,
                         [rng_key(request_ids[i], params[i].seed, token_indices[i]) for i in rows],
                         [_top_k(p.top_k, V) for p in sampled]], dtype=torch.int64)
    floats = torch.tensor([[p.temperature for p in sampled], [p.top_p for p in sampled],
                           [p.min_p for p in sampled]], dtype=torch.float32)
    ints, floats = _to_device(ints, dev), _to_device(floats, dev)
    row_idx, keys, top_k = ints
    enabled_k = [p.top_k for p in sampled if 0 < p.top_k < V]
    x = filter_logits(logits.index_select(0, row_idx), floats[0], top_k, floats[1],
                      max(enabled_k, default=0), any(p.top_p < 1.0 for p in sampled),
                      floats[2] if any(p.min_p > 0 for p in sampled) else None)
    gumbel = -torch.log(-torch.log(uniform_noise(keys, V)))
    return ids.index_copy(0, row_idx, torch.argmax(x.double() + gumbel, dim=-1))


def _top_k(k: int, vocab_size: int) -> int:
    """``k`` as an int64 with the same meaning: any k >= V disables top-k, as V does."""
    return min(k, vocab_size)


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    request_ids: Sequence[str],
    token_indices: Sequence[int],
    tokens: RowTokens | None = None,
) -> list[int | SamplingFailure]:
    """:func:`sample_batch_tensor`, then one device-to-host transfer of the ids.

    If the batch raises, each row is sampled alone (a row's draw does not depend on the
    others, so the good rows get the tokens the batch would have given them) and a row
    that still raises gets a :class:`SamplingFailure` in place of its id.

    Returns:
        ``[B]``: a token id per row, or a :class:`SamplingFailure`.

    Raises:
        ValueError: the per-row lists do not match the batch size.
    """
    B = _check_rows(logits, params, request_ids, token_indices)
    try:
        return sample_batch_tensor(logits, params, request_ids, token_indices, tokens).tolist()
    except Exception as exc:  # noqa: BLE001 - find the row(s) at fault, fail only those
        logger.warning("sampling a batch of %d rows raised %s: %s; sampling each row alone",
                       B, type(exc).__name__, exc)
    out: list[int | SamplingFailure] = []
    for i in range(B):
        try:
            out += sample_batch_tensor(logits[i:i + 1], params[i:i + 1], request_ids[i:i + 1],
                                       token_indices[i:i + 1],
                                       None if tokens is None else tokens.rows(i, i + 1)).tolist()
        except Exception as exc:  # noqa: BLE001 - this row's request fails, not the step
            out.append(SamplingFailure(f"{type(exc).__name__}: {exc}"))
    return out
