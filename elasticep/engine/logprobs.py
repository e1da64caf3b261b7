"""Log-probabilities of chosen tokens and their top alternatives, from raw logits.

vLLM's default (``logprobs_mode="raw_logprobs"``): the log-softmax of the logits the
model returned, in float32, before logit bias, penalties, temperature and the top-k,
top-p and min-p filters. So a logprob is the model's own, comparable with
transformers' on the same checkpoint, and a greedy token is always the most likely
one unless a bias or penalty moved it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from elasticep.engine.request import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                   num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Each row's logprob of ``token_ids[i]`` and its ``num_top[i]`` most likely tokens.

    One log-softmax over the rows and one device-to-host copy.

    Args:
        logits: ``[R, V]`` any float dtype, any device (raw model logits).
        token_ids: ``[R]`` the token whose logprob each row reports, in ``[0, V)``.
        num_top: ``[R]`` how many alternatives per row, each >= 0.

    Returns:
        ``[R]`` :class:`TokenLogprobs`; ``top`` is most likely first.

    Raises:
        ValueError: the lists do not have ``R`` items.
    """
    R = logits.shape[0]
    if not len(token_ids) == len(num_top) == R:
        raise ValueError(f"{R} logit rows but {len(token_ids)} token ids and "
                         f"{len(num_top)} top counts")
    if R == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None]).squeeze(1)
    k = min(max(num_top), lp.shape[1])
    if k > 0:
        top_vals, top_ids = torch.topk(lp, k, dim=-1)
        host = torch.cat([chosen[:, None], top_vals], 1).cpu().tolist(), top_ids.cpu().tolist()
    else:
        host = chosen[:, None].cpu().tolist(), [[] for _ in range(R)]
    vals, tids = host
    return [TokenLogprobs(int(t), float(v[0]),
                          tuple(zip(tids[i][:num_top[i]], v[1:1 + num_top[i]], strict=True)))
            for i, (t, v) in enumerate(zip(token_ids, vals, strict=True))]
