"""What reaches the page from users and the model: labels, highlighted chunks, answers, and the
lines that say what an answer cost.

Chunk text is HTML-escaped before it is wrapped in highlight tags; labels keep only plain
characters; answers (and questions) are shown as plain text (`st.text`), never as Markdown, so a
link or an image the model writes is shown as the characters it wrote, streamed or redrawn.

The describing lines tell what happened, not what was asked for: an answer the read-whole policy
gave to Full Attention says "read whole (short context)", not "fusionrag (recompute 15%)", and its
chunks are shown without highlights (kvrag.options.AnswerOptions.whole_reason).
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from kvrag.options import RATIO_FREE

EMPTY_ANSWER = "(empty answer)"
BASELINE = "full"


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


def chunk_views(rag: Any, pre: Any, whole: bool = False) -> list[ChunkView]:
    """Each retrieved chunk of a prefill with its recomputed tokens (`pre.selected`, global positions) marked;
    `whole`: the prompt was read whole (Full Attention by policy), so nothing is marked. A chunk the
    prefix-cache hit held (an earlier turn's KV) is labelled so."""
    selected = set() if whole else {int(p) for p in pre.selected.tolist()}
    stitched = getattr(pre, "stitched", None)
    kept = None
    if not whole and stitched is not None and pre.stats.kept_kv_ratio < 1.0:
        kept = {int(p) for p in stitched.positions.tolist()}
    views = []
    for i, (start, ids) in enumerate(zip(pre.segments.chunk_starts, pre.segments.chunks)):
        chunk = pre.chunks[i] if i < len(pre.chunks) else None
        n_sel = sum(1 for p in range(start, start + len(ids)) if p in selected)
        title = plain_label(chunk.title if chunk and chunk.title else (chunk.id if chunk else f"chunk {i + 1}"), 60)
        if int(getattr(pre.stats, "prefix_hit_tokens", 0)) >= start + len(ids):
            how = ("read whole, " if whole else "") + f"KV from the prefix cache, {len(ids)} tokens"
        else:
            how = f"read whole, {len(ids)} tokens" if whole else f"{n_sel}/{len(ids)} tokens recomputed"
        views.append(
            ChunkView(
                label=f"{i + 1}. {title}: {how}",
                html=highlight_html(token_pieces(rag.lm.tokenizer, ids), start, selected, kept),
                tokens=len(ids),
                recomputed=n_sel,
            )
        )
    return views


# -- what an answer cost, in words ----------------------------------------------------------------
def whole_kind(reason: str) -> str:
    """The read-whole policy a `stats.full_reason` names: "short context" or "records of one kind"."""
    if "records of one kind" in reason:
        return "records of one kind"
    if "chunk tokens <=" in reason:
        return "short context"
    return "by policy"


def method_line(method: str, ratio: float, stats: Mapping[str, Any]) -> str:
    """What read the prompt: "read whole (short context)" when the policy gave it to Full Attention,
    else the method and its recompute share as chosen."""
    if stats.get("full_reason"):
        return f"read whole ({whole_kind(str(stats['full_reason']))})"
    if method == BASELINE:
        return "Full Attention (full)"
    return method + ("" if method in RATIO_FREE else f" (recompute {ratio:.0%})")


def short_name(method: str, stats: Mapping[str, Any]) -> str:
    """The answer's name in the speed-up's label: the method, or "read whole"."""
    return "read whole" if stats.get("full_reason") else method


def prefix_line(stats: Mapping[str, Any]) -> str:
    """The exact prefix cache's part: "reused 612 of 640 prompt tokens from the previous turn", or no hit."""
    hit, total = int(stats.get("prefix_hit_tokens", 0)), int(stats.get("prompt_tokens", 0))
    if hit <= 0:
        return "no prefix-cache hit"
    source = "the previous turn" if int(stats.get("turns", 1)) > 1 else "an earlier answer over the same chunks"
    return f"reused {hit} of {total} prompt tokens from {source}"


def speed_source(stats: Mapping[str, Any]) -> str:
    """Which cache a speed-up came from: this session's earlier turn (the exact prefix cache, salted per
    session), the chunks' stored KV, or neither (read whole)."""
    parts = []
    if int(stats.get("prefix_hit_tokens", 0)) > 0:
        parts.append("this session's earlier turn (the exact prefix cache)")
    if not stats.get("full_reason") and str(stats.get("method", "")) != BASELINE and int(stats.get("context_tokens", 0)) > 0:
        parts.append("the chunks' stored KV")
    return " and ".join(parts) or "no cache: read whole, as Full Attention reads it"


def counts_line(stats: Mapping[str, Any]) -> str:
    """This answer's own counts (its chunk-store lookups too: the sidebar's are cumulative)."""
    return (
        f"This answer: {stats['prompt_tokens']} prompt tokens ({stats['context_tokens']} from chunks), "
        f"{stats['recomputed_tokens']} chunk tokens computed this turn; chunk KV store lookups for this answer: "
        f"{stats['cache_hits']} hits, {stats['cache_misses']} misses; {stats['generated_tokens']} tokens generated."
    )


def covered_by_prefix(stats: Mapping[str, Any], views: Sequence[ChunkView]) -> bool:
    """Whether the prefix-cache hit held every chunk token (so no chunk was read or recomputed this turn)."""
    return int(stats.get("prefix_hit_tokens", 0)) > 0 and int(stats.get("recomputed_tokens", 0)) == 0 and bool(views)


def chunks_caption(method: str, stats: Mapping[str, Any], views: Sequence[ChunkView]) -> str:
    """What the chunk list below shows: read whole, from the previous turn, or the recomputed tokens."""
    reason = str(stats.get("full_reason") or "")
    from_prefix = covered_by_prefix(stats, views)
    if reason:
        return (
            f"Read whole: {method}'s reuse did not apply ({reason}), so every chunk token was read with Full "
            "Attention" + (" (in an earlier turn: this turn took that KV from the prefix cache)" if from_prefix else "")
            + ". Nothing is highlighted because nothing was reused from the chunk cache."
        )
    if from_prefix:
        return (
            f"These chunks' KV came from the previous turn (the prefix cache holds it as {method} left it): "
            "nothing was recomputed or read from the chunk store this turn."
        )
    if not any(v.recomputed for v in views):  # full reuse, kvlink: no chunk token recomputed
        return f"{method} recomputed none of these tokens: every chunk came from the precomputed KV cache."
    return (
        f"Highlighted: the tokens {method} recomputed; the rest came from the precomputed KV cache"
        + (" (struck-through tokens were dropped from the cache)" if method == "samkv" else "")
        + "."
    )
