"""What retrieval answers: the index's nearest entries, screened one by one, the skipped ones replaced by
the next-ranked good ones.

Why (issue 69): an index writer without the store key could still steer answers. Unsigned decoys placed at
a question's vector took top-k slots and were dropped without replacement (5 decoys left 1 source of 5);
moving a signed entry's vector onto another question made it retrieved first; re-adding an old signed
version after a replace, or a deleted entry, answered it again. Each entry is now screened in rank order:
its MAC under the store key (kvrag.ingest.index_trust), its vector's MAC (or, for an entry signed before
vectors were, the distance from its vector to its text embedded again), and whether the store's id index
binds its id to its text (`Binding`, set by the server). A row with fewer than k good entries is asked
again deeper, up to `deep_limit(k)` entries. What was skipped before the k-th good entry is kept per
thread (`last_skipped`) for the response's `kvrag_dropped`, each as `{"id", "reason"}`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvrag.ingest.index_trust import count_unverified_index
from kvrag.types import Chunk

log = logging.getLogger("kvrag.ingest")

REEMBED_MAX_DISTANCE = 1e-3  # cosine distance between a legacy entry's vector and its text embedded again
NO_MAC = "its MAC under the store key is missing or wrong (not written by a kvrag holding the key)"
MOVED = "its vector is not the one signed with its text (moved in the index)"
REEMBEDDED = "its vector is not its text's embedding (moved in the index)"
NO_VECTOR = "the index returned no vector to check it against"

_local = threading.local()


class Binding(Protocol):
    """Why each chunk, as the index holds it, is not what the store binds its id to (None: it is)."""

    def __call__(self, chunks: Sequence[Chunk]) -> list[str | None]: ...


def deep_limit(k: int) -> int:
    """How many entries a row is asked for at most, however many are skipped: a bound on the work an
    index writer can cause, while a few bad entries never cost a good one its place."""
    return max(4 * k, k + 64)


def last_skipped() -> list[dict[str, str]]:
    """The entries this thread's last retrieval skipped before its k-th good one, `{"id", "reason"}` each
    (what the server names in `kvrag_dropped`)."""
    return list(getattr(_local, "skipped", ()))


def _remember(skipped: list[dict[str, str]]) -> None:
    _local.skipped = skipped


def _cosine_distance(a: Sequence[float], b: Sequence[float]) -> float:
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    denom = float(np.linalg.norm(x) * np.linalg.norm(y)) or 1.0
    return 1.0 - float(x @ y) / denom


class Screen:
    """One retrieval's screening: `row` screens one question's ranked entries."""

    def __init__(self, verify: Callable[[str, Any, Any], bool], vector_verdict: Callable[[Any, Any], str],
                 to_chunk: Callable[[str, Any, Any], Chunk], embed: Callable[[str], Sequence[float]],
                 binding: Binding | None) -> None:
        self.verify, self.vector_verdict, self.to_chunk, self.embed, self.binding = verify, vector_verdict, to_chunk, embed, binding

    def _vector_reason(self, text: Any, meta: Any, vector: Any) -> str | None:
        verdict = self.vector_verdict(meta, vector)
        if verdict == "ok":
            return None
        if verdict == "moved":
            return MOVED
        if verdict == "missing":
            return NO_VECTOR
        try:  # signed before vectors were: its text embedded again must be where it is found
            far = _cosine_distance(self.embed(text if isinstance(text, str) else ""), vector) > REEMBED_MAX_DISTANCE
        except Exception as exc:  # noqa: BLE001 (an entry whose text cannot be embedded is not answered)
            return f"its vector could not be checked ({type(exc).__name__})"
        return REEMBEDDED if far else None

    def row(self, ids: Sequence[str], docs: Sequence[Any], metas: Sequence[Any],
            vectors: Sequence[Any] | None) -> list[tuple[str, Chunk | None, str | None]]:
        """Each entry in rank order: (id, its chunk when good, else None, and why it was skipped)."""
        out: list[tuple[str, Chunk | None, str | None]] = []
        candidates: list[int] = []
        for j, (i, d, m) in enumerate(zip(ids, docs, metas)):
            if not self.verify(i, d, m):
                out.append((i, None, NO_MAC))
                continue
            why = self._vector_reason(d, m, None if vectors is None else vectors[j])
            if why is not None:
                out.append((i, None, why))
                continue
            out.append((i, self.to_chunk(i, d, m), None))
            candidates.append(j)
        if self.binding is not None and candidates:
            verdicts = self.binding([out[j][1] for j in candidates])  # type: ignore[misc]
            for j, why in zip(candidates, verdicts):
                if why is not None:
                    out[j] = (out[j][0], None, why)
        return out


def pick(screened: list[tuple[str, Chunk | None, str | None]], k: int) -> tuple[list[Chunk], list[dict[str, str]]]:
    """The first k good chunks, and what was skipped before the k-th (each id once)."""
    good: list[Chunk] = []
    skipped: list[dict[str, str]] = []
    for chunk_id, chunk, why in screened:
        if len(good) >= k:
            break
        if chunk is not None:
            good.append(chunk)
        elif why is not None:
            skipped.append({"id": str(chunk_id), "reason": why})
    return good, skipped


def query_screened(ask: Callable[[list[int], int], list[tuple[list, list, list, list | None]]], rows: int, k: int,
                   count: int, screen: Screen) -> list[list[Chunk]]:
    """Each row's k best good chunks: `ask(rows, n)` answers the n nearest entries of those rows (ids,
    documents, metadatas, vectors or None); a row short of k good ones is asked again deeper (twice as
    many), up to `deep_limit(k)` and the index's `count`. The skips are kept for `last_skipped` (every
    row's, each id once: the rows are one conversation's turns)."""
    out: list[list[Chunk]] = [[] for _ in range(rows)]
    skips: list[list[dict[str, str]]] = [[] for _ in range(rows)]
    limit = min(count, deep_limit(k))
    n = min(k, count)
    todo = list(range(rows))
    while todo:
        answers = ask(todo, n)
        short = []
        for r, (ids, docs, metas, vectors) in zip(todo, answers):
            out[r], skips[r] = pick(screen.row(ids, docs, metas, vectors), k)
            if len(out[r]) < k and len(ids) >= n and n < limit:
                short.append(r)
        todo = short
        n = min(limit, max(2 * n, n + k))
    seen: set[str] = set()
    named = []
    for row in skips:
        for s in row:
            if s["id"] not in seen:
                seen.add(s["id"])
                named.append(s)
    beyond_mac = sum(1 for row in skips for x in row if x["reason"] != NO_MAC)
    if beyond_mac:  # those failing their MAC are counted where they are checked (index_trust.verified_entry)
        count_unverified_index(beyond_mac)
    if named:
        log.info("retrieval skipped %d index entr%s: %s", len(named), "y" if len(named) == 1 else "ies",
                 "; ".join(f"{s['id']!r}: {s['reason']}" for s in named[:5]))
    _remember(named)
    return out
