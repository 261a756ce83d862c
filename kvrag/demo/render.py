"""What reaches the page from users and the model: labels, highlighted chunks, answers.

Chunk text is HTML-escaped before it is wrapped in highlight tags; labels keep only plain
characters; answers are shown as plain text (`st.text`), never as Markdown, so a link or an image
the model writes is shown as the characters it wrote, streamed or redrawn.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

EMPTY_ANSWER = "(empty answer)"


def plain_label(text: str, limit: int = 80) -> str:
    """Text safe to put in a Streamlit markdown label: letters, digits and simple punctuation only."""
    cleaned = re.sub(r"[^\w .,:;!?()'/-]+", " ", text or "", flags=re.UNICODE)
    cleaned = " ".join(cleaned.split())
    return cleaned[:limit] + ("..." if len(cleaned) > limit else "")


def show_answer(text: str, container: Any = None) -> None:
    """An answer as plain text: no Markdown, no links, no images."""
    import streamlit as st

    (container or st).text(text or EMPTY_ANSWER)


def stream_answer(pieces: Iterable[str], container: Any = None) -> str:
    """Stream text pieces into one plain-text element (updated as they come); returns the whole text."""
    import streamlit as st

    slot = (container or st).empty()
    text = ""
    for piece in pieces:
        text += piece
        slot.text(text)
    if not text:
        slot.text(EMPTY_ANSWER)
    return text


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[tuple[int, int, str]]:
    """(first, end, text) for runs of tokens that decode to whole characters, in order.

    Tokens are decoded cumulatively, so a character split across byte-level tokens is shown once,
    attached to the run of tokens that completes it, instead of as replacement characters.
    """
    pieces: list[tuple[int, int, str]] = []
    emitted, first = "", 0
    for i in range(len(ids)):
        text = tokenizer.decode(list(ids[: i + 1]), skip_special_tokens=False)
        if text.endswith("\ufffd") and i + 1 < len(ids):
            continue  # an incomplete character: wait for the token that finishes it
        if text.startswith(emitted):
            pieces.append((first, i + 1, text[len(emitted) :]))
        else:  # decoding is not prefix-stable here; fall back to this token on its own
            pieces.append((first, i + 1, tokenizer.decode([ids[i]], skip_special_tokens=False)))
        emitted, first = text, i + 1
    return pieces


def highlight_html(pieces: Sequence[tuple[int, int, str]], start: int, selected: set[int], kept: set[int] | None) -> str:
    """Escaped HTML of one chunk: recomputed tokens in <mark>, tokens a sparse method dropped in <s>.

    Neighbouring pieces of the same kind share one tag, which keeps the page small.
    """
    runs: list[tuple[str, str]] = []  # (kind, escaped text)
    for first, end, text in pieces:
        positions = range(start + first, start + end)
        if any(p in selected for p in positions):
            kind = "mark"
        elif kept is not None and not any(p in kept for p in positions):
            kind = "dropped"
        else:
            kind = ""
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1] + html.escape(text))
        else:
            runs.append((kind, html.escape(text)))
    tags = {"mark": ("<mark>", "</mark>"), "dropped": ('<s style="opacity:0.45">', "</s>"), "": ("", "")}
    body = "".join(tags[kind][0] + text + tags[kind][1] for kind, text in runs)
    return '<div style="white-space:pre-wrap;font-size:0.88em;line-height:1.5">' + body + "</div>"


@dataclass
class ChunkView:
    """One retrieved chunk as shown on the page (plain data: it is kept in session state)."""

    label: str
    html: str
    tokens: int
    recomputed: int


def chunk_views(rag: Any, pre: Any) -> list[ChunkView]:
    """Each retrieved chunk of a prefill with its recomputed tokens (`pre.selected`, global positions) marked."""
    selected = {int(p) for p in pre.selected.tolist()}
    stitched = getattr(pre, "stitched", None)
    kept = {int(p) for p in stitched.positions.tolist()} if stitched is not None and pre.stats.kept_kv_ratio < 1.0 else None
    views = []
    for i, (start, ids) in enumerate(zip(pre.segments.chunk_starts, pre.segments.chunks)):
        chunk = pre.chunks[i] if i < len(pre.chunks) else None
        n_sel = sum(1 for p in range(start, start + len(ids)) if p in selected)
        title = plain_label(chunk.title if chunk and chunk.title else (chunk.id if chunk else f"chunk {i + 1}"), 60)
        views.append(
            ChunkView(
                label=f"{i + 1}. {title}: {n_sel}/{len(ids)} tokens recomputed",
                html=highlight_html(token_pieces(rag.lm.tokenizer, ids), start, selected, kept),
                tokens=len(ids),
                recomputed=n_sel,
            )
        )
    return views

