"""Structured output: a grammar's token mask on a request's logits rows (xgrammar).

A request with :attr:`SamplingParams.grammar` gets a matcher on the rank that runs it.
Each step masks its logits row to the tokens the grammar allows next, before the
sampler draws (:meth:`Grammars.mask`, between the forward and the sampler: eager, also
where the forward replayed a CUDA graph); the committed token then advances the matcher
(:meth:`Grammars.accept`). Masking reads the matcher and changes nothing, so a step
redone after a rank failure masks the same way; only the commit advances it.

A request resumed on a survivor carries its generated tokens: :meth:`Grammars.add`
replays them into a fresh matcher, so the grammar continues where it stood on the dead
rank, and the continuation is the one the fault-free run draws.

xgrammar (and with it transformers, for the tokenizer's vocabulary) is imported on a
rank only when its first grammar request arrives.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from elasticep.engine.request import GRAMMAR_KINDS, GrammarSpec

logger = logging.getLogger(__name__)

# A JSON object of any shape: the meaning of OpenAI's response_format "json_object".
_ANY_OBJECT = '{"type": "object"}'


def _grammar(spec: GrammarSpec) -> Any:
    """The xgrammar ``Grammar`` of ``spec`` (no vocabulary needed).

    JSON comes without free whitespace between tokens (as OpenAI's JSON mode writes it):
    a grammar that allows any whitespace lets a small model pad until max_tokens.

    Raises:
        ValueError: an unknown kind, or a spec xgrammar cannot parse (its message).
    """
    import xgrammar as xgr

    try:
        if spec.kind in ("json_schema", "json_object"):
            return xgr.Grammar.from_json_schema(
                spec.spec if spec.kind == "json_schema" else _ANY_OBJECT, any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        # xgrammar's message starts with "[time] /path/file.cc:line: "; keep the reason
        reason = str(exc).strip().rsplit(": ", 1)[-1] if ".cc:" in str(exc) else str(exc)
        raise ValueError(f"invalid {spec.kind}: {reason}") from None
    raise ValueError(f"unknown grammar kind {spec.kind!r} (known: {', '.join(GRAMMAR_KINDS)})")


def check_grammar(spec: GrammarSpec) -> None:
    """Parse ``spec`` up front (the front-end's 400 instead of a rank's refusal).

    Raises:
        ValueError: as :func:`_grammar`.
    """
    _grammar(spec)


class GrammarCompiler:
    """Compiles grammars for one vocabulary; compiled grammars are cached by spec.

    Args:
        tokenizer_dir: the model directory holding the tokenizer.
        vocab_size: the logits' width (the model's ``vocab_size``, which may exceed the
            tokenizer's: the extra ids are always masked).
        stop_token_ids: the ids that end generation (EOS); the grammar allows them once
            it is complete.

    Raises:
        OSError / ValueError: the tokenizer cannot be loaded.
    """

    def __init__(self, tokenizer_dir: str, vocab_size: int,
                 stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: dict[GrammarSpec, Any] = {}

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec`` (xgrammar's ``CompiledGrammar``).

        Raises:
            ValueError: as :func:`_grammar`.
        """
        if spec not in self._cache:
            self._cache[spec] = self._compiler.compile_grammar(_grammar(spec))
        return self._cache[spec]


class Grammars:
    """The matchers of one engine's grammar requests, by request id.

    Args:
        make_compiler: builds the :class:`GrammarCompiler` at the first grammar request;
            None: this engine refuses grammar requests.
    """

    def __init__(self, make_compiler: Callable[[], GrammarCompiler] | None = None) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._matchers: dict[str, Any] = {}

    def _get_compiler(self) -> GrammarCompiler:
        if self._make_compiler is None:
            raise ValueError("this engine has no grammar backend (structured output)")
        with self._lock:
            if self._compiler is None:
                try:
                    self._compiler = self._make_compiler()
                except (OSError, ValueError) as exc:  # e.g. a config-only directory
                    raise ValueError("structured output needs the model's tokenizer, which "
                                     f"cannot be loaded: {exc}") from exc
                logger.info("grammar backend ready (xgrammar, vocabulary %d)",
                            self._compiler.vocab_size)
        return self._compiler

    def add(self, request_id: str, spec: GrammarSpec, replay: Sequence[int] = ()) -> None:
        """Start ``request_id``'s matcher and feed it ``replay`` (a resumed request's
        generated tokens).

        Raises:
            ValueError: no backend, a bad spec, or a replayed token the grammar refuses
                (the tokens did not come from this grammar).
        """
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self._get_compiler().compile(spec))
        for i, tok in enumerate(replay):
            if not matcher.accept_token(int(tok)):
                raise ValueError(f"request {request_id!r}: resumed token {i} ({tok}) does not "
                                 f"follow its {spec.kind}")
        self._matchers[request_id] = matcher

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def mask(self, logits: torch.Tensor, request_ids: Sequence[str]) -> None:
        """Set to -inf, in place, every logit a row's grammar forbids next; rows of
        requests without a grammar are untouched. Changes no matcher.

        Args:
            logits: ``[B, V]`` float, any device; row i is ``request_ids[i]``'s.
            request_ids: per row.
        """
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return
        import xgrammar as xgr

        V = logits.shape[1]
        bitmask = xgr.allocate_token_bitmask(len(request_ids), V)
        for i in rows:
            matcher = self._matchers[request_ids[i]]
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, i)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=V, indices=rows)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance ``request_id``'s matcher by its committed token.

        Returns:
            True when the grammar is complete (its stop token taken): the request ends.
        """
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(int(token_id)):
            logger.warning("request %s: token %d is not allowed by its grammar", request_id,
                           token_id)
        return matcher.is_terminated()

    def drop(self, request_id: str) -> None:
        """Forget ``request_id``'s matcher (finished or aborted)."""
        self._matchers.pop(request_id, None)
