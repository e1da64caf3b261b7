"""Changes to the raw logits before sampling: logit bias, ``min_tokens``, penalties.

The order is vLLM's (its v1 sampler), so the same request gives the same distribution:

1. ``logit_bias`` is added to the raw logits;
2. while a row has fewer than ``min_tokens`` outputs, EOS (unless ``ignore_eos``) and
   its ``stop_token_ids`` are masked to -inf;
3. ``repetition_penalty`` over the tokens of prompt + output (divide a positive
   logit, multiply a negative one: Keskar et al. 2019, CTRL);
4. ``frequency_penalty`` times each token's count in the output and
   ``presence_penalty`` for each token present in the output are subtracted (OpenAI).

Temperature, ``min_p``, top-k and top-p come after, in :mod:`elasticep.engine.sampler`.
Every input is the request's tokens themselves (prompt and outputs so far), so the
state is rebuilt from scratch each step: a request resumed on a survivor from prompt +
generated tokens gets exactly the logits it would have had on its first rank.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from elasticep.engine.request import SamplingParams


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to ``device`` without blocking the host on CUDA (pinned, async)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    eos_ids: Collection[int] = (),
) -> torch.Tensor:
    """The logits after bias, ``min_tokens`` and penalties (module doc), as float32.

    Rows whose params need none of it (:attr:`SamplingParams.needs_processing` False)
    come back unchanged (as float32). The per-row token lists reach the device in one
    copy of flat ``(row, token)`` indices; ids outside ``[0, V)`` are ignored.

    Args:
        logits: ``[B, V]`` any float dtype, any device.
        params: ``[B]`` each row's sampling settings.
        prompts: ``[B]`` each row's prompt token ids.
        outputs: ``[B]`` each row's output token ids so far.
        eos_ids: the model's EOS ids (masked under ``min_tokens``).

    Returns:
        ``[B, V]`` float32 on ``logits.device`` (a new tensor).

    Raises:
        ValueError: the per-row lists do not have ``B`` items.
    """
    B, V = logits.shape
    if not len(params) == len(prompts) == len(outputs) == B:
        raise ValueError(f"{B} logit rows but {len(params)} params, {len(prompts)} prompts "
                         f"and {len(outputs)} outputs")
    x = logits.float().clone()
    rows = [i for i, p in enumerate(params) if p.needs_processing]
    if not rows:
        return x
    # (row, token, value) triples of four kinds, sent in one host->device copy:
    # bias adds value; mask sets -inf; rep marks presence in prompt+output; out counts
    bias: list[tuple[int, int, float]] = []
    mask: list[tuple[int, int]] = []
    rep: list[tuple[int, int]] = []
    out: list[tuple[int, int]] = []
    for i in rows:
        p = params[i]
        bias += [(i, t, b) for t, b in p.logit_bias if t < V]
        if len(outputs[i]) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            mask += [(i, t) for t in stops if t < V]
        if p.repetition_penalty != 1:
            rep += [(i, t) for t in set(prompts[i]) | set(outputs[i]) if 0 <= t < V]
        if p.frequency_penalty != 0 or p.presence_penalty != 0:
            out += [(i, t) for t in outputs[i] if 0 <= t < V]
    dev = x.device
    if bias:
        r, t, b = zip(*bias, strict=True)
        idx = _to(torch.tensor([r, t], dtype=torch.int64), dev)
        x.index_put_((idx[0], idx[1]), _to(torch.tensor(b, dtype=torch.float32), dev),
                     accumulate=True)
    if mask:
        idx = _to(torch.tensor(mask, dtype=torch.int64).T, dev)
        x[idx[0], idx[1]] = float("-inf")
    if rep:
        penalty = _to(torch.tensor([p.repetition_penalty for p in params],
                                   dtype=torch.float32), dev)
        idx = _to(torch.tensor(rep, dtype=torch.int64).T, dev)
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[idx[0], idx[1]] = True
        pen = penalty[:, None]
        x = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
    if out:
        freq = _to(torch.tensor([[p.frequency_penalty for p in params],
                                 [p.presence_penalty for p in params]],
                                dtype=torch.float32), dev)
        idx = _to(torch.tensor(out, dtype=torch.int64).T, dev)
        counts = torch.zeros_like(x)
        counts.index_put_((idx[0], idx[1]), torch.ones(idx.shape[1], device=dev),
                          accumulate=True)
        x = x - freq[0][:, None] * counts - freq[1][:, None] * (counts > 0).float()
    return x


def min_p_filter(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf the tokens whose probability is below ``min_p`` times the top one's.

    Args:
        x: ``[R, V]`` float32 temperature-scaled logits whose row maximum is 0 (so
            ``p / p_max = exp(x)``).
        min_p: ``[R]`` float32 in [0, 1]; 0 keeps every token.

    Returns:
        ``[R, V]`` float32; the top token is always kept.
    """
    return x.masked_fill(x < torch.log(min_p)[:, None], float("-inf"))
