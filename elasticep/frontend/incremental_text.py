"""Incremental detokenization with stop strings, one token at a time.

Byte-level BPE tokens may end inside a UTF-8 character, and some tokenizers change how a
token prints depending on its left context. So each step decodes a short window
(``ids[prefix_offset:]``) and releases only the text beyond the window's already-seen
part, and only once it no longer ends in U+FFFD (an incomplete character).

Stop strings are searched in the decoded text. While stop strings are set, the last
``len(longest stop) - 1`` characters are held back, because they could turn out to be
the start of a stop string that the next token completes; the text streamed to a client
therefore never contains (part of) a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]
REPLACEMENT_CHAR = "\ufffd"


def first_stop(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest stop string begins in ``text[start:]`` (an index into
    ``text``), or None; empty stop strings never match (pure)."""
    hits = [i for s in stop if s and (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to (without) its earliest stop string (pure)."""
    cut = first_stop(text, stop)
    return text if cut is None else text[:cut]


class IncrementalText:
    """Turns a stream of token ids into a stream of text deltas, honouring stop strings.

    Args:
        decode: token ids -> text (for example ``tokenizer.decode`` with
            ``skip_special_tokens=True``).
        stop: stop strings; empty strings are ignored.
    """

    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (left context)
        self._read_offset = 0  # tokens before this are already in self._text
        self._text = ""  # decoded text so far (cut at the stop string once stopped)
        self._released = 0  # characters of self._text handed out
        self.stopped = False  # a stop string was found

    @property
    def text(self) -> str:
        """All text decoded so far (without a stop string), released or not."""
        return self._text

    def push(self, token_id: int) -> str:
        """Add one token; return the text newly safe to show (possibly "").

        After :attr:`stopped` becomes True, further tokens are ignored and "" returned.
        """
        if self.stopped:
            return ""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        if len(window) > len(prefix) and not window.endswith(REPLACEMENT_CHAR):
            self._append(window[len(prefix):])
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush text still held back (incomplete characters, stop-string lookahead)."""
        if not self.stopped and self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            window = self._decode(self._ids[self._prefix_offset:])
            if len(window) > len(prefix):
                self._append(window[len(prefix):])
            self._read_offset = len(self._ids)
        return self._release(final=True)

    def _append(self, new: str) -> None:
        start = max(0, len(self._text) - self._holdback)
        self._text += new
        cut = first_stop(self._text, self._stop, start)
        if cut is not None:
            self._text = self._text[:cut]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self._text)
        if not (final or self.stopped):
            end -= self._holdback
        if end <= self._released:
            return ""
        delta = self._text[self._released:end]
        self._released = end
        return delta
