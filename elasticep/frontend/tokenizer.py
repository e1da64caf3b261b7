"""The tokenizer of a model directory, or a stand-in that takes token ids only.

A ``--load-format dummy`` directory may hold only ``config.json``. Like vLLM with
``--skip-tokenizer-init``, such a model still serves prompts given as token ids; text
prompts get a clear error, and generated ids render as ``<id>`` per token so that
streamed output stays visible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
