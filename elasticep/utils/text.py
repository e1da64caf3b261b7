"""Checks of user text before it reaches a tokenizer."""

from __future__ import annotations


def unicode_problem(text: str) -> str | None:
    """What makes ``text`` not valid Unicode, or None when it is (pure).

    A Python ``str`` can hold a lone surrogate: JSON's ``\\ud800`` escape decodes to one,
    and so does a command-line byte that is not UTF-8 (``surrogateescape``). No tokenizer
    takes it: the HF fast tokenizer raises a ``TypeError``.

    Returns:
        e.g. ``"is not valid Unicode: surrogates not allowed at character 2"``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not valid Unicode: {exc.reason} at character {exc.start}"
    return None
