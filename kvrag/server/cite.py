"""The sources block an answer may end with: "Sources: [1] <title> (<file>)", one line a document.

Why in the text: an OpenAI client shows the answer's text and little else. The retrieved chunks ride
in `kvrag_sources` (a field LangChain's ChatOpenAI drops) and in the `X-KVRag-Sources` header (ids
only), so a user of such a client cannot see what the answer read. With `kvrag serve --cite-sources`
(ServerSettings.cite_sources) or a request's `"kvrag": {"cite": true}`, the server appends this block
to the answer (a last piece when streaming). Off by default: an answer is what the model said.
"""

from __future__ import annotations

from typing import Any, Iterable

MAX_LABEL_CHARS = 160  # a title or file name longer than this is cut (a block of sources, not of titles)


def _one_line(text: str) -> str:
    """A title or file name as one line (a title with newlines could otherwise forge source lines)."""
    flat = " ".join(str(text or "").split())
    return flat if len(flat) <= MAX_LABEL_CHARS else flat[: MAX_LABEL_CHARS - 1] + "…"


def label(source: dict[str, Any]) -> str:
    """`Title (file)`, or whichever of the two the chunk has, or its id when it has neither."""
    title, name = _one_line(source.get("title", "")), _one_line(source.get("source", ""))
    if title and name:
        return f"{title} ({name})"
    return title or name or _one_line(source.get("id", ""))


def sources_block(sources: Iterable[dict[str, Any]] | None) -> str:
    """The block to append ("\\n\\nSources:\\n[1] ...\\n[2] ..."): one line per document, in retrieval
    order (chunks of one document, alike in title and file, share a line); "" when nothing was retrieved."""
    labels = list(dict.fromkeys(label(s) for s in sources or ()))
    labels = [lb for lb in labels if lb]
    if not labels:
        return ""
    return "\n\nSources:\n" + "\n".join(f"[{i}] {lb}" for i, lb in enumerate(labels, 1))


def with_sources(answer: str, block: str) -> str:
    """The answer with the block after it (without the blank line when the answer is empty)."""
    if not block:
        return answer
    return answer + block if answer else block.lstrip("\n")
