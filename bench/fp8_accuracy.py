"""How far block-FP8 weights move a model: top-1 agreement and KL against the original.

The demo model (or ``--model``) is loaded twice on the CPU in float32: as it is, and with
``--quantization fp8`` (every linear weight but the router gates and the LM head rounded
through 128 x 128 block FP8, the format of DeepSeek-V3's and the Qwen3 FP8 checkpoints).
Both score the same token sequences: GSM8K prompts followed by the original model's own
greedy continuation (teacher forcing, so both see identical inputs at every position).
Per position, over the continuation's positions:

- top-1 agreement: the share where both models' most likely next token is the same;
- KL(original || FP8) of the next-token distributions, in nats, averaged.

No real FP8 checkpoint can be downloaded here: the FP8 model is the original quantized
while loading, which is what an FP8 release of it would hold.

Prints one JSON line.

    python -m bench.fp8_accuracy [--prompts 32] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench._commit import commit
from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.request import SamplingParams
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.prompts import gsm8k_prompts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--prompts", type=int, default=32, help="GSM8K prompts (at most 64)")
    p.add_argument("--tokens", type=int, default=32, help="greedy continuation per prompt")
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok(t).input_ids for t in gsm8k_prompts(args.prompts)]
    base = LLMEngine.from_pretrained(args.model, dtype=torch.float32, progress=False)
    fp8 = LLMEngine.from_pretrained(args.model, dtype=torch.float32, progress=False,
                                    quantization="fp8")
    conts = base.generate(prompts, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
    agree = total = 0
    kl_sum = 0.0
    greedy_same = 0
    fp8_conts = fp8.generate(prompts, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
    for prompt, cont, cont8 in zip(prompts, conts, fp8_conts, strict=True):
        seq = prompt + cont[:-1]
        lp = torch.log_softmax(base.prompt_logits(seq)[len(prompt) - 1:].float(), -1)
        lq = torch.log_softmax(fp8.prompt_logits(seq)[len(prompt) - 1:].float(), -1)
        agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
        total += lp.shape[0]
        kl_sum += float((lp.exp() * (lp - lq)).sum(-1).sum())
        greedy_same += int(cont == cont8)
    print(json.dumps({
        "bench": "fp8_accuracy", "commit": commit(), "model": Path(args.model).name,
        "prompts": len(prompts), "tokens_per_prompt": args.tokens, "positions": total,
        "top1_agreement": round(agree / total, 4), "mean_kl_nats": round(kl_sum / total, 6),
        "greedy_identical_prompts": greedy_same,
        "note": "FP8 = the same model quantized while loading (--quantization fp8); no real "
                "FP8 checkpoint can be downloaded here"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
