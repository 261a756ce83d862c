"""Issue #17: a model that recites a chunk header ("Document: eiffel") before answering has not
answered yet. Such leading lines are left out of the answer, the stream and the stop rules."""

import pytest
import torch

from kvrag import Chunk, KVRag, from_model
from kvrag.decode.stream import DecodeConfig, DecodeState, _stream, leading_echo
from kvrag.kv.layout import PromptLayout
from tiny import tiny_model, tiny_tokenizer

HEADERS = {"Document: eiffel", "Document: wall"}


@pytest.mark.parametrize(
    "text,start,held",
    [
        ("Document: eiffel\nThe tower", 17, None),  # a whole header line: the answer starts after it
        ("  Document: wall\n\nDocument: eiffel\nIt", 35, None),  # several, with blank lines between
        ("Document: eif", 0, 0),  # could still become a header: held back from its start
        ("\n Docu", 0, 2),
        ("Document: eiffel is tall\nx", 0, None),  # a line that says more than the header is an answer
        ("Document: none of them say\n", 0, None),
        ("It was 1889.\nDocument: wall\n", 0, None),  # only leading lines: later ones are the answer's
        ("1889", 0, None),
    ],
)
def test_leading_header_lines_are_skipped_and_partial_ones_held(text, start, held):
    assert leading_echo(text, 0, HEADERS) == (start, held)


def test_no_headers_skip_nothing():
    assert leading_echo("Document: eiffel\nx", 0, set()) == (0, None)


def test_the_layout_names_each_chunk_header_line():
    layout = PromptLayout(tiny_tokenizer(), "v1")  # the layout with "Document:" header lines
    chunks = [Chunk("e", "The Eiffel Tower.", "eiffel"), Chunk("w", "A wall.", "wall"), Chunk("u", "Untitled text.")]
    assert layout.header_lines(chunks) == {"Document: eiffel", "Document: wall"}  # untitled: header and text share a line
    inline = PromptLayout(tiny_tokenizer(), chunk_template="[{title}] {text}\n\n")
    assert inline.header_lines(chunks) == set()
    assert PromptLayout(tiny_tokenizer(), chunk_template="{text}\n\n").header_lines(chunks) == set()
    assert PromptLayout(tiny_tokenizer(), "chat").header_lines(chunks) == set()  # the texts alone: no header
    assert PromptLayout(tiny_tokenizer()).header_lines(chunks) == {"eiffel", "wall"}  # the default: a titled chunk's title line


def _scripted(text: str, cfg: DecodeConfig, headers=HEADERS):
    """Decode `text` token by token through the real loop, a byte tokenizer and scripted logits."""
    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    vocab = lm.model.config.vocab_size

    def logits_for(i: int) -> torch.Tensor:
        out = torch.zeros(vocab)
        if i < len(ids):
            out[ids[i]] = 1.0
        else:
            out[next(iter(_eos(lm)))] = 1.0
        return out

    step = {"i": 0}

    def forward(token: int, position: int) -> torch.Tensor:
        step["i"] += 1
        return logits_for(step["i"])

    state = DecodeState()
    pieces = list(_stream(lm, forward, logits_for(0), 10, cfg, state, None, headers))
    return pieces, state


def _eos(lm):
    from kvrag.decode.stream import eos_ids

    return sorted(eos_ids(lm))


@pytest.mark.parametrize("stop_at", ["sentence", "line", "none"])
def test_a_recited_header_never_reaches_the_stream_or_ends_the_answer(stop_at):
    pieces, state = _scripted("Document: eiffel\nIt was completed in 1889.\nMore text", DecodeConfig(max_new_tokens=80, stop_at=stop_at))
    answer = "".join(pieces)
    assert not any("Document" in p for p in pieces)
    assert state.echoed == "Document: eiffel\n"
    expected = {"sentence": "It was completed in 1889.", "line": "It was completed in 1889.", "none": "It was completed in 1889.\nMore text"}
    assert answer == expected[stop_at]


def test_an_answer_that_only_looks_like_a_header_at_first_is_streamed_whole():
    pieces, state = _scripted("Document: none of them says.\nx", DecodeConfig(max_new_tokens=80, stop_at="line"))
    assert "".join(pieces) == "Document: none of them says."
    assert state.echoed == ""


def test_a_header_cut_short_by_the_token_limit_is_kept():
    text = "Document: eif"
    pieces, state = _scripted(text, DecodeConfig(max_new_tokens=len(text), stop_at="line"))
    assert "".join(pieces) == text and state.echoed == ""


def test_without_headers_the_stream_is_unchanged():
    pieces, state = _scripted("Document: eiffel\nIt was 1889.", DecodeConfig(max_new_tokens=80, stop_at="line"), headers=())
    assert "".join(pieces) == "Document: eiffel"


def test_the_engine_reports_the_header_it_left_out():
    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://")
    chunks = [Chunk("e", "The Eiffel Tower was completed in 1889.", "eiffel")]
    rag.precompute(chunks, progress=False)
    ans = rag.answer("When?", ["e"], method="full", max_new_tokens=12)
    assert ans.stats.echoed_header == ""  # a random tiny model recites nothing: the field is there, empty
    assert "echoed_header" in ans.stats.as_dict()
