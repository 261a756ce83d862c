"""Retrieval degrades, never refuses: what the server retrieved is checked before it is answered from.

The index is shared and written by others (`kvrag ingest`, any write key through any replica), so one
bad entry must not break every question that retrieves it, nor be blamed on the client with a 400. A
retrieved chunk with no text, with text no tokenizer encodes, or too long to fit the model's context
with a question is skipped; when the rest do not fit together (with the conversation and the answer's
`max_tokens`), the lowest-ranked are dropped until they do. Each is logged and named in the response's
`kvrag_dropped` (`[{"id", "reason"}]`). A 400 stays for what the client itself sent.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from kvrag.chat import Conversation
from kvrag.kv.repository import QUESTION_ROOM
from kvrag.options import AnswerOptions
from kvrag.types import Chunk

log = logging.getLogger("kvrag.server")


def _link_tokens(opts: AnswerOptions, adapter_tokens: int | None) -> int:
    """The KVLink link slots each chunk adds to the prompt under this request's method (0 for the others)."""
    meth = opts.resolved_method()
    if getattr(meth, "name", "") != "kvlink":
        return 0
    own = getattr(meth, "link_tokens", None)
    return int(own if own is not None else adapter_tokens or 0)


def _chunk_ids(layout: Any, chunk: Chunk) -> list[int]:
    """A retrieved chunk's token ids, memoised only if they were already (the engine reads them the same way)."""
    try:
        return layout.chunk_ids(chunk, memo=False)
    except TypeError:  # a layout without the memo switch
        return layout.chunk_ids(chunk)


def fit_retrieved(rag: Any, conv: Conversation, found: Sequence[Chunk], opts: AnswerOptions,
                  adapter_tokens: int | None = None) -> tuple[list[Chunk], list[dict[str, str]]]:
    """(the chunks to answer from, in their order; those dropped, each `{"id", "reason"}`)."""
    layout, limit = rag.layout, rag.lm.max_context
    room = limit - len(layout.prefix_ids) - QUESTION_ROOM
    kept: list[Chunk] = []
    ids: list[list[int]] = []
    dropped: list[dict[str, str]] = []

    def drop(chunk: Chunk, reason: str) -> None:
        log.warning("retrieved chunk %r skipped: %s", chunk.id, reason)
        dropped.append({"id": str(chunk.id), "reason": reason})

    for chunk in found:
        if not isinstance(chunk.text, str) or not chunk.text.strip():
            drop(chunk, "the index holds no text for it")
            continue
        try:
            tokens = _chunk_ids(layout, chunk)
        except Exception as exc:  # noqa: BLE001 (text a tokenizer refuses: a lone surrogate, ...)
            drop(chunk, f"its text cannot be tokenised ({type(exc).__name__})")
            continue
        if len(tokens) > room:
            drop(chunk, f"{len(tokens)} tokens with its title: more than the {room} that fit the model's context with a question")
            continue
        kept.append(chunk)
        ids.append(tokens)
    links = _link_tokens(opts, adapter_tokens)
    reserve = opts.decode.max_new_tokens
    while kept:
        total = layout.conversation_segments(ids, conv, links=links).total_len
        if total + reserve <= limit:
            break
        last = kept.pop()
        ids.pop()
        drop(last, f"the retrieved chunks ({total} prompt tokens, +{reserve} to answer) did not fit the model's context "
                   f"({limit}): the lowest-ranked are dropped until they do")
    return kept, dropped
