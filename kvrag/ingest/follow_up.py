"""Which chunks a conversation's follow-up reads, in which order, so the exact prefix cache serves it.

A follow-up retrieves anew (with its recent user turns: `Conversation.retrieval_query`) and the
ranking may change: the same documents in another order would start the prompt differently, and
turn two would read the whole conversation again instead of only its new tokens. So the chunks the
turn before read come first, in that turn's order, then the new ones in rank order (`keep_order`).

A client that sends the whole history (every OpenAI client) carries no chunk ids, so
`conversation_chunks` replays retrieval for each user turn, the index answering every query in one
call: the order is a function of the messages and the index alone, the same on every replica and for
every method, Full Attention included (what a turn reads never depends on a cache being warm).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from kvrag.chat import RETRIEVAL_TURNS, Conversation
from kvrag.types import Chunk

# user turns replayed at most: a longer conversation's oldest turns no longer decide the order
MAX_REPLAYED_TURNS = 16


class ManyQueries(Protocol):
    def query_many(self, questions: Sequence[str], k: int = 5) -> list[list[Chunk]]: ...


def keep_order(chunks: Sequence[Chunk], previous: Sequence[str]) -> list[Chunk]:
    """A follow-up's chunks: those the turn before read too first, in that turn's order, then the new
    ones in rank order (the same prompt start is what lets the prefix cache serve the follow-up: all of
    it for the same chunks, the shared start otherwise)."""
    by_id = {c.id: c for c in chunks}
    seen = set(previous)
    return [by_id[i] for i in previous if i in by_id] + [c for c in chunks if c.id not in seen]


def turn_queries(conv: Conversation, turns: int = RETRIEVAL_TURNS) -> list[str]:
    """The retrieval query of each user turn so far, oldest first (the last one is this turn's)."""
    queries = []
    for end, (role, _) in enumerate(conv.turns):
        if role == "user":
            queries.append(Conversation(turns=conv.turns[: end + 1]).retrieval_query(turns))
    return queries[-MAX_REPLAYED_TURNS:]


def conversation_chunks(index: ManyQueries, conv: Conversation, k: int, turns: int = RETRIEVAL_TURNS) -> list[Chunk]:
    """This turn's top-k chunks, ordered so that those every earlier turn kept come first as it read them."""
    order: list[Chunk] = []
    for found in index.query_many(turn_queries(conv, turns), k=k):
        order = keep_order(found, [c.id for c in order])
    return order
