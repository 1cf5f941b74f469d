"""The gateway's text handling: incremental detokenization and stop trimming."""

from __future__ import annotations

import pytest

from specserve.gateway.text import IncrementalDetokenizer, StopTrimmer


def test_incremental_detokenizer_never_splits_characters(tokenizer):
    text = "naïve café — 你好，世界! 🙂🚀 done"
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(lambda t: tokenizer.decode(t, skip_special_tokens=True))
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize(
    "pieces, stops, expected",
    [
        (["Hello wor", "ld. Bye"], ["world"], "Hello "),
        (["ab", "c", "STO", "P tail"], ["STOP"], "abc"),
        (["no stop here"], ["STOP"], "no stop here"),
        (["x", "yz"], [], "xyz"),
    ],
)
def test_stop_trimmer(pieces, stops, expected):
    trimmer = StopTrimmer(stops)
    out = "".join(trimmer.push(p) for p in pieces) + trimmer.flush()
    assert out == expected
