"""Single-process engine: add requests, step, collect tokens.

A step is split so the multi-rank engine can redo it after a rank dies:

    batch = engine.schedule()          # plan; allocates KV blocks, no token state changes
    tokens = engine.execute(batch)     # forward + sample; pure except idempotent KV writes
    outputs = engine.commit(batch, tokens)   # append tokens, finish, free; the only mutation

``step()`` is those three in a row. A row whose sampling raised carries a
:class:`~elasticep.engine.sampler.SamplingFailure` from ``execute``; ``commit`` ends
that one request with an error output (finish_reason "abort", ``error`` set) and the
step goes on for the others.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from elasticep.engine.grammar import GrammarCompiler, Grammars
from elasticep.engine.kv_cache import BlockManager
from elasticep.engine.logprobs import token_logprobs
from elasticep.engine.model_runner import ModelRunner
from elasticep.engine.prompt_scoring import PromptScoring
from elasticep.engine.request import GenerateRequest, SamplingParams, TokenLogprobs, TokenOutput
from elasticep.engine.sampler import RowTokens, SamplingFailure, sample_batch
from elasticep.engine.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from elasticep.engine.sequence import Sequence, SequenceStatus
from elasticep.models.config import MoEModelConfig
from elasticep.models.model import MoECausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits.

    Attributes:
        max_total_tokens: KV-cache capacity in tokens (rounded up to whole blocks).
        block_size: tokens per KV block.
        max_num_seqs: most sequences in one step.
        max_batch_tokens: per-step token budget for admitting prefills.
        forward_empty_batches: run the model even with nothing scheduled (T = 0), as an
            idle rank must under expert parallelism so every MoE layer's dispatch lines up.
        enable_cuda_graph: capture the decode forward in CUDA graphs at start-up where
            the model allows it (CUDA, an executor without collectives); SGLang's
            ``--disable-cuda-graph`` turns it off.
        cuda_graph_max_bs: the largest captured decode batch, and so the last bucket
            the EP exchange is rounded up to (SGLang's ``--cuda-graph-max-bs``); the
            ranks of a deployment must agree on it. None: ``max_num_seqs``.
        chunked_prefill_size: most prefill tokens per step (SGLang's
            ``--chunked-prefill-size``): longer prompts are split over steps that
            running decodes share. None computes each prompt in one step.

    Raises:
        ValueError: ``chunked_prefill_size`` below 1.
    """

    max_total_tokens: int = 8192
    block_size: int = 16
    max_num_seqs: int = 64
    max_batch_tokens: int = 4096
    forward_empty_batches: bool = False
    enable_cuda_graph: bool = True
    cuda_graph_max_bs: int | None = None
    chunked_prefill_size: int | None = None

    def __post_init__(self) -> None:
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1 or None, got {self.chunked_prefill_size}")


def max_sequence_len(model_config: MoEModelConfig, config: EngineConfig | None) -> int:
    """The longest sequence (prompt + generated tokens) the engine runs, in tokens: the
    context, the whole KV cache (whole blocks; ``config`` None: no cache limit), and a
    sliding window, where our full attention would differ. The API advertises this same
    number as ``max_model_len``."""
    limits = [model_config.max_position_embeddings]
    if config is not None:
        limits.append(-(-config.max_total_tokens // config.block_size) * config.block_size)
    if model_config.attention_window:
        limits.append(model_config.attention_window)
    return min(limits)


def grammar_compiler_for(model_dir: str | Path, model_config: MoEModelConfig,
                         ) -> Callable[[], GrammarCompiler]:
    """The structured-output backend of a model directory, to build when first needed
    (its tokenizer's vocabulary over the logits' width, EOS as the stop tokens)."""
    return lambda: GrammarCompiler(str(model_dir), model_config.vocab_size,
                                   model_config.eos_token_ids)


class LLMEngine:
    """Continuous-batching engine over one :class:`MoECausalLM`.

    Args:
        model: the loaded model (any executor).
        config: engine limits.
        detokenize: ids -> text, needed only for ``stop`` strings.
        grammar_compiler: builds the structured-output backend at the first request with
            a grammar (:class:`~elasticep.engine.grammar.GrammarCompiler`); None: such
            requests are refused.
    """

    def __init__(
        self,
        model: MoECausalLM,
        config: EngineConfig | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        grammar_compiler: Callable[[], GrammarCompiler] | None = None,
    ) -> None:
        self.model = model
        self.config = config or EngineConfig()
        num_blocks = -(-self.config.max_total_tokens // self.config.block_size)
        self.blocks = BlockManager(num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_batch_tokens,
                                   self.config.chunked_prefill_size)
        self.runner = ModelRunner(model, num_blocks, self.config.block_size)
        self.detokenize = detokenize
        self.grammars = Grammars(grammar_compiler)
        self.eos_ids = set(model.config.eos_token_ids)
        self.max_seq_len = max_sequence_len(model.config, self.config)
        self._arrival = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        # what the last execute computed besides the tokens, for commit: request id ->
        # the sampled token's logprobs, and -> {prompt position: logprobs}
        self._step_logprobs: dict[str, TokenLogprobs] = {}
        self._step_prompt_logprobs: dict[str, dict[int, TokenLogprobs]] = {}
        self.cuda_graph_capture_s: float | None = None
        if self.config.enable_cuda_graph:
            self.cuda_graph_capture_s = self.runner.enable_cuda_graphs(
                self.config.cuda_graph_max_bs or self.config.max_num_seqs, self.max_seq_len)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        config: EngineConfig | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        progress: bool = True,
        load_format: str = "auto",
        quantization: str | None = None,
    ) -> LLMEngine:
        """Load ``model_dir`` with every expert local and wrap it in an engine.

        ``load_format`` "dummy" draws the weights from a seed (config.json only);
        ``quantization`` "fp8" rounds an unquantized checkpoint through block FP8.
        """
        from elasticep.models.loader import load_model

        model = load_model(model_dir, dtype=dtype, device=device, progress=progress,
                           load_format=load_format, quantization=quantization)
        return cls(model, config, detokenize, grammar_compiler_for(model_dir, model.config))

    def add_request(self, req: GenerateRequest) -> None:
        """Queue a request (a resumed one carries its ``output_token_ids``).

        Raises:
            ValueError: bad sampling params, duplicate id, empty prompt, a resumed request
                that is already complete, or a prompt (plus resumed tokens) longer than the
                context, the sliding window or the whole KV cache.
        """
        req.params.validate()
        if req.request_id in self._seqs:
            raise ValueError(f"request id {req.request_id!r} is already running")
        n = len(req.prompt_token_ids) + len(req.output_token_ids)
        if not req.prompt_token_ids:
            raise ValueError(f"request {req.request_id!r} has an empty prompt")
        if len(req.output_token_ids) >= req.params.max_tokens:
            raise ValueError(
                f"request {req.request_id!r} already has {len(req.output_token_ids)} of "
                f"max_tokens={req.params.max_tokens} tokens"
            )
        if n >= self.max_seq_len:
            raise ValueError(
                f"request {req.request_id!r}: prompt of {n} tokens does not fit: context "
                f"{self.model.config.max_position_embeddings}, KV cache {self.blocks.capacity_tokens} "
                f"tokens, longest sequence {self.max_seq_len}"
            )
        if req.params.grammar is not None:  # a resumed request's tokens replayed into it
            self.grammars.add(req.request_id, req.params.grammar, req.output_token_ids)
        seq = Sequence.from_request(req, next(self._arrival))
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request; True if it was known."""
        seq = self._seqs.pop(request_id, None)
        self.grammars.drop(request_id)
        if seq is None:
            return False
        self.scheduler.remove(request_id)
        return True

    def request_ids(self) -> list[str]:
        """Ids of the requests this engine holds (waiting or running), in arrival order."""
        return list(self._seqs)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    def schedule(self) -> ScheduledBatch:
        """Plan the next step (see module doc)."""
        return self.scheduler.schedule()

    def execute(self, batch: ScheduledBatch,
                while_running: Callable[[], object] | None = None
                ) -> list[int | SamplingFailure]:
        """Forward + sample one token per scheduled sequence that :attr:`~ScheduledSeq.samples`
        (a chunk that leaves part of its prompt for later draws none), in batch order;
        mutates no request state.

        A row whose sampling raised gets a :class:`SamplingFailure` (see
        :func:`~elasticep.engine.sampler.sample_batch`); a forward error raises.

        ``while_running`` is called once the forward is launched and before the host waits
        for it (on CUDA, host work there overlaps the device's); also for a batch that
        forwards nothing.
        """
        self._step_logprobs = {}
        self._step_prompt_logprobs = {}
        if not batch.items and not self.config.forward_empty_batches:
            if while_running is not None:
                while_running()
            return []
        scoring = PromptScoring.of(batch)  # a prompt whose logprobs are asked for
        if scoring is None:
            logits = self.runner.forward(batch)
        else:
            out = self.runner.forward_rows(batch, scoring.rows)
            logits, scored = out[:scoring.num_sampling], out[scoring.num_sampling:]
        if while_running is not None:
            while_running()
        seqs = [it.seq for it in batch.items if it.samples]
        # structured output: a grammar's mask applies before sampling (and so before the
        # logprobs of those rows, which are over the tokens the grammar allows)
        self.grammars.mask(logits, [s.request_id for s in seqs])
        tokens = sample_batch(
            logits,
            [s.params for s in seqs],
            [s.request_id for s in seqs],
            [len(s.output_token_ids) for s in seqs],
            RowTokens([s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
                      self.eos_ids),
        )
        rows = [i for i, (s, t) in enumerate(zip(seqs, tokens, strict=True))
                if s.params.logprobs is not None and type(t) is int]
        if rows:
            lps = token_logprobs(logits[rows], [int(tokens[i]) for i in rows],  # type: ignore[arg-type]
                                 [seqs[i].params.logprobs or 0 for i in rows])
            self._step_logprobs = {seqs[i].request_id: lp for i, lp in zip(rows, lps, strict=True)}
        if scoring is not None:
            self._step_prompt_logprobs = scoring.logprobs(scored)
        return tokens

    def commit(self, batch: ScheduledBatch,
               tokens: Seq[int | SamplingFailure]) -> list[TokenOutput]:
        """Record the computed K/V, append sampled tokens (``tokens`` as :meth:`execute`
        returns them), finish sequences that are done and return their outputs.

        A :class:`SamplingFailure` row ends its request: it is finished and dropped, and
        its output has finish_reason "abort", no token and the failure as ``error``.

        Raises:
            ValueError: ``tokens`` does not have one entry per sampling sequence.
        """
        sampling = [it for it in batch.items if it.samples]
        if len(tokens) != len(sampling):
            raise ValueError(f"{len(tokens)} tokens for {len(sampling)} sampling sequences")
        for it in batch.items:
            scored = self._step_prompt_logprobs.get(it.seq.request_id)
            if scored is not None and it.seq.status is SequenceStatus.RUNNING:
                it.seq.prompt_logprobs.update(scored)
            if not it.samples and it.seq.status is SequenceStatus.RUNNING:
                it.seq.num_cached_tokens = it.end  # a prefill chunk: the rest comes later
        outputs = []
        for it, tok in zip(sampling, tokens, strict=True):
            seq = it.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted between execute and commit
            if isinstance(tok, SamplingFailure):
                log.warning("request %s failed: sampling raised %s", seq.request_id, tok.message)
                self.scheduler.finish(seq, "abort")
                self._seqs.pop(seq.request_id, None)
                self.grammars.drop(seq.request_id)
                outputs.append(TokenOutput(seq.request_id, len(seq.output_token_ids), None,
                                           "abort", error=f"sampling failed: {tok.message}"))
                continue
            seq.num_cached_tokens = it.end
            first = seq.wants_prompt_logprobs
            seq.output_token_ids.append(int(tok))
            complete = self.grammars.accept(seq.request_id, int(tok))
            reason = "stop" if complete else self._finish_reason(seq, int(tok))
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._seqs.pop(seq.request_id, None)
                self.grammars.drop(seq.request_id)
            outputs.append(TokenOutput(
                seq.request_id, len(seq.output_token_ids) - 1, int(tok), reason,
                logprobs=self._step_logprobs.get(seq.request_id),
                prompt_logprobs=tuple(seq.prompt_logprobs[p] for p in sorted(seq.prompt_logprobs))
                if first else None))
        return outputs

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if p.stop and self.detokenize is not None:
            text = self.detokenize(seq.output_token_ids)
            if any(s and s in text for s in p.stop):  # "" is no stop string
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_seq_len:
            return "length"
        return None

    def step(self) -> list[TokenOutput]:
        """schedule -> execute -> commit; returns the tokens generated this step."""
        batch = self.schedule()
        return self.commit(batch, self.execute(batch))

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[list[int]]:
        """Run ``prompts`` to completion as one batch; return generated ids in input order.

        Raises:
            RuntimeError: a prompt's sampling failed (the batch's other prompts are
                aborted).
        """
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        prefix = f"gen{next(self._arrival)}-"
        results: dict[str, list[int]] = {f"{prefix}{i}": [] for i in range(len(prompts))}
        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            self.add_request(GenerateRequest(f"{prefix}{i}", tuple(prompt), p))
        while any(rid in self._seqs for rid in results):
            for out in self.step():
                if out.error is not None and out.request_id in results:
                    for rid in results:
                        self.abort(rid)
                    raise RuntimeError(f"prompt {out.request_id[len(prefix):]}: {out.error}")
                if out.request_id in results:
                    results[out.request_id].append(out.token_id)
        return [results[f"{prefix}{i}"] for i in range(len(prompts))]

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits ``[n, V]`` for every position of ``token_ids``, computed through
        the paged cache with temporary blocks (perplexity, tests)."""
        seq = Sequence("__score__", list(token_ids), [], SamplingParams(), -1)
        if not self.blocks.can_grow(seq.block_table, len(token_ids)):
            raise ValueError(f"{len(token_ids)} tokens do not fit in the free KV cache")
        self.blocks.grow(seq.block_table, len(token_ids))
        try:
            batch = ScheduledBatch((ScheduledSeq(seq, 0, len(token_ids)),))
            return self.runner.forward(batch, all_logits=True)
        finally:
            self.blocks.free(seq.block_table)
