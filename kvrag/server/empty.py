"""A chat request the server retrieved for and found nothing for says so (issue 70, item 5).

Before anything is ingested, a plain OpenAI request used to get an invented answer, with only `kvrag_sources: []` to
tell: a field LangChain's ChatOpenAI drops. So such an answer carries the warning three ways: the `X-KVRag-Warning`
header, the `kvrag_warning` field (in the first and last chunk when streaming), and, unless the request opts out
(`"kvrag": {"warn_in_answer": false}`), a first line of the answer's text, the one place every client shows.
/metrics counts them (`kvrag_answers_without_documents_total`, by reason).
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import Counter

_MAKING = threading.Lock()  # answers start in worker threads: the counter is made once per registry

WARNING_HEADER = "X-KVRag-Warning"
EMPTY = "empty"  # the index returned no chunk (nothing ingested, or nothing in this collection)
DROPPED = "dropped"  # it returned chunks, and none could be read (kvrag_dropped says why)

MESSAGES = {
    EMPTY: "no document matched: the server's retrieval index returned nothing (is anything ingested?), so this "
           "answer is the model's own, not from your documents",
    DROPPED: "no document matched: none of the chunks retrieved could be read (see kvrag_dropped), so this answer "
             "is the model's own, not from your documents",
}


def warning_for(retrieved: list[Any] | None, dropped: list[Any] | None) -> str | None:
    """The reason an answer read no document although the server retrieved for it (None: it read some, or it
    did not retrieve: the request brought its own context or asked for plain chat)."""
    if retrieved is None or retrieved:
        return None
    return DROPPED if dropped else EMPTY


def first_line(reason: str) -> str:
    """What opens the answer's text: one line, then a blank one, then the model's answer."""
    return f"[kvrag: {MESSAGES[reason]}.]\n\n"


def headers(reason: str | None) -> dict[str, str]:
    """The warning as a header (ASCII, one line): for clients that show headers but not the body's extra fields."""
    return {} if reason is None else {WARNING_HEADER: MESSAGES[reason]}


def fields(reason: str | None) -> dict[str, Any]:
    """The `kvrag_warning` field of the response body."""
    return {} if reason is None else {"kvrag_warning": MESSAGES[reason]}


def counter_of(metrics: Any) -> Counter:
    """This app's counter of answers without documents, in its own registry (kvrag.server.metrics.ServerMetrics
    .registry), made on the first chat request so that metrics.py need not know of it."""
    with _MAKING:
        counter = getattr(metrics, "_answers_without_documents", None)
        if counter is not None:
            return counter
        counter = Counter("kvrag_answers_without_documents", "Chat answers for which the server retrieved and found no "
                          "document to read (empty: the index returned nothing; dropped: none of what it returned could "
                          "be read); each says so in X-KVRag-Warning, kvrag_warning and, unless the request opts out, "
                          "its first line", ["reason"], registry=metrics.registry)
        for name in (EMPTY, DROPPED):
            counter.labels(name)  # both series from the start: a scrape sees 0, not nothing
        metrics._answers_without_documents = counter
        return counter


def count(metrics: Any, reason: str) -> None:
    """One more answer without documents on /metrics."""
    counter_of(metrics).labels(reason).inc()
