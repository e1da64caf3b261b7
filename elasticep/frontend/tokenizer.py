"""The tokenizer of a model directory, or a stand-in that takes token ids only.

A ``--load-format dummy`` directory may hold only ``config.json``. Like vLLM with
``--skip-tokenizer-init``, such a model still serves prompts given as token ids; text
prompts get a clear error, and generated ids render as ``<id>`` per token so that
streamed output stays visible.

:class:`TokenizerPool` runs tokenizer calls off the event loop on a few threads, each
with its own copy of the tokenizer (a fast tokenizer's Rust object must not be used
by two threads at once; its encode releases the GIL, so the threads run in parallel).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

# Any one of these is enough for transformers' AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class NoTokenizerError(ValueError):
    """A text prompt for a model directory that has no tokenizer."""


class TokenIdsOnlyTokenizer:
    """The part of a transformers tokenizer the engine uses, for a model without one.

    Args:
        model_dir: the model directory (named in errors).
        vocab_size: the config's ``vocab_size``; token ids must lie in ``[0, vocab_size)``.
    """

    chat_template = None
    model_max_length = 1 << 62

    def __init__(self, model_dir: str | Path, vocab_size: int) -> None:
        self.model_dir = str(model_dir)
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, **_: Any) -> list[int]:
        """Raises:
            NoTokenizerError: always; this model takes token-id prompts only.
        """
        raise NoTokenizerError(f"{self.model_dir} has no tokenizer: send the prompt as token "
                               "ids (a list of ints)")

    def __call__(self, text: str, **kw: Any) -> Any:
        return self.encode(text, **kw)

    def decode(self, ids: list[int], **_: Any) -> str:
        """``<id>`` for each token: the ids stay readable in a text response."""
        return "".join(f"<{int(i)}>" for i in ids)


def has_tokenizer(model_dir: str | Path) -> bool:
    """True when ``model_dir`` holds tokenizer files."""
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path) -> Any:
    """transformers' ``AutoTokenizer`` of ``model_dir``, or a :class:`TokenIdsOnlyTokenizer`
    when the directory has no tokenizer files.

    Raises:
        OSError / ValueError: from transformers, for tokenizer files it cannot read.
    """
    if not has_tokenizer(model_dir):
        vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
        return TokenIdsOnlyTokenizer(model_dir, vocab)
    from transformers import AutoTokenizer  # heavy: imported only where text is needed

    return AutoTokenizer.from_pretrained(str(model_dir))


def streaming_decode(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """ids -> text without special tokens, for streaming: the Rust tokenizer's own
    ``decode`` where transformers' would only wrap it (a fast tokenizer that cleans up
    no spaces, as Qwen's and Llama 3's), else transformers' ``decode``.

    The front-end decodes twice per streamed token (:mod:`.incremental_text`);
    transformers' wrapper (argument conversion, ``to_py_obj`` over the ids) cost 4x the
    decode itself (5.3 against 1.3 us a call on the demo tokenizer) and was the largest
    part of detokenizing under py-spy at 256 streams.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    decode = backend.decode
    return lambda ids: decode(ids if type(ids) is list else list(ids), skip_special_tokens=True)


class TokenizerPool:
    """Tokenizer calls on ``size`` threads, each owning a copy of ``tokenizer``, so that
    one giant prompt (seconds of encoding) holds up one thread, not every request.

    A short call may run on the event loop itself instead (:meth:`run` with ``inline``),
    with a copy of its own: under load, the hop to a pool thread and back (the result
    waits behind every callback the loop has queued) cost a short prompt tens of ms
    before routing, far more than encoding it (about 0.3 ms of CPU for 256 tokens).
    The pool threads also contend with the loop for the GIL: an encode releases and
    retakes it several times, and each retake waits for the loop thread to let go
    (over ten times longer than alone, next to a spinning thread here), while every GIL
    release of the loop's own (a socket send, ``os.urandom``) may wait on the pool.

    Args:
        tokenizer: a transformers tokenizer (or :class:`TokenIdsOnlyTokenizer`); each
            thread deep-copies it on first use. One that cannot be copied gets a single
            thread (logged), as before the pool, and no inline calls.
        size: number of threads (>= 1).

    Raises:
        ValueError: ``size`` < 1.
    """

    def __init__(self, tokenizer: Any, size: int) -> None:
        if size < 1:
            raise ValueError(f"a tokenizer pool needs >= 1 thread, got {size}")
        self._prototype = tokenizer
        self._spares: list[Any] = []
        if size > 1:
            try:
                self._spares.append(copy.deepcopy(tokenizer))  # can it be copied at all?
            except Exception as exc:  # noqa: BLE001 - any tokenizer class may refuse
                logger.warning("the tokenizer cannot be copied (%r): tokenizing on one "
                               "thread", exc)
                size = 1
        self.size = size
        # the loop's own copy (None: every call goes to the pool)
        self._inline = copy.deepcopy(tokenizer) if size > 1 else None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(size, thread_name_prefix="tokenizer")

    def _own(self) -> Any:
        if self.size == 1:
            return self._prototype
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._lock:
                spare = self._spares.pop() if self._spares else None
            tok = spare if spare is not None else copy.deepcopy(self._prototype)
            self._local.tokenizer = tok
        return tok

    async def run(self, fn: Callable[..., T], *args: Any, inline: bool = False) -> T:
        """``fn(tokenizer, *args)`` on a pool thread with that thread's own tokenizer, or
        with ``inline`` (a call the caller knows is short) on the calling thread, the
        event loop's, with the loop's own copy where there is one; its exceptions
        propagate."""
        if inline and self._inline is not None:
            return fn(self._inline, *args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, lambda: fn(self._own(), *args))

    def close(self) -> None:
        """Stop the threads (calls still queued are cancelled)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
