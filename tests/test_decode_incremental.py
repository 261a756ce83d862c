"""Decoding writes into reserved room and detokenises incrementally, with the same text as before."""

import pytest
import torch

from kvrag.model.cache import SpliceCache
from kvrag.decode.stream import IncrementalText
from tiny import tiny_tokenizer

TEXTS = [
    "The Brannoch Line opened in 1893.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Accents: café, naïve, Zürich — and dashes – too.",
    "CJK 東京タワー and emoji 🚂🚃 mixed with ASCII.",
    "Numbers 3.14159, 2,718 and 1e-9; code: `x = f(y)[0]`.",
]


def _check(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    inc = IncrementalText(tok)
    pieces = [inc.add(t) for t in ids]
    pieces.append(inc.flush())
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == inc.text == full


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_a_full_decode_on_a_byte_tokenizer(text):
    _check(tiny_tokenizer(), text)


@pytest.mark.smollm
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_a_full_decode_on_smollm(smollm, text):
    _check(smollm.tokenizer, text)


def test_incremental_text_never_decodes_the_whole_answer_per_step():
    tok = tiny_tokenizer()
    ids = tok.encode("word " * 200, add_special_tokens=False)
    seen = []
    real = tok.decode

    def counting(token_ids, **kw):
        seen.append(len(token_ids))
        return real(token_ids, **kw)

    tok.decode = counting
    inc = IncrementalText(tok)
    for t in ids:
        inc.add(t)
    assert inc.text == "word " * 200
    assert max(seen) <= 4  # a few tokens of context each step, never the whole answer


def test_appends_write_into_reserved_room_without_reallocating():
    k = torch.randn(1, 2, 5, 4)
    cache = SpliceCache([(k.clone(), k.clone())], reserve=8)
    layer = cache.layers[0]
    buf = layer._kbuf.data_ptr()
    for step in range(8):
        new = torch.full((1, 2, 1, 4), float(step))
        keys, _ = layer.update(new, new)
        assert keys.shape[2] == 6 + step and torch.equal(keys[:, :, -1], new[:, :, 0])
    assert layer._kbuf.data_ptr() == buf  # every token went into the reserved room
    assert torch.equal(layer.keys[:, :, :5], k)
    layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))  # past the room: grows once, keeps the content
    assert layer.keys.shape[2] == 14 and torch.equal(layer.keys[:, :, :5], k)
