"""The front-end's streaming decode (``streaming_decode``): the Rust tokenizer's own
decode gives transformers' text, special tokens skipped, on the demo tokenizer."""

from __future__ import annotations

from elasticep.frontend.incremental_text import IncrementalText
from elasticep.frontend.tokenizer import load_tokenizer, streaming_decode
from elasticep_testkit.paths import DEMO_MODEL


def test_streaming_decode_matches_transformers_decode_with_special_tokens_skipped():
    tok = load_tokenizer(DEMO_MODEL)
    decode = streaming_decode(tok)
    assert decode is not None and tok.clean_up_tokenization_spaces is False
    text = "Hello, wörld! 你好 🙂 a  b\n\tc"
    ids = tok.encode(text)
    special = tok.all_special_ids[:2]
    for sample in (ids, ids[3:7], [*special, *ids, *special], [], ids[:1]):
        assert decode(sample) == tok.decode(sample, skip_special_tokens=True)
    assert decode(tuple(ids)) == tok.decode(ids, skip_special_tokens=True)
    # streamed one token at a time, the deltas add up to the whole text
    inc = IncrementalText(decode)
    assert "".join(inc.push(t) for t in ids) + inc.finish() == text


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode():
    class Cleaning:
        clean_up_tokenization_spaces = True
        backend_tokenizer = object()  # never used: its decode would skip the clean-up

        def decode(self, ids, skip_special_tokens=False):
            return f"{list(ids)}:{skip_special_tokens}"

    assert streaming_decode(Cleaning())([1, 2]) == "[1, 2]:True"
