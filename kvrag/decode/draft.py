"""Prompt-lookup drafting: guess the next tokens by finding where the answer's last tokens occurred before.

Why: a RAG answer copies from its documents ("completed in 1889 for the World's Fair"), and on the CPU
a forward over three rows costs little more than over one (a step reads the weights once either way:
58 vs 66 ms a step for the bundled model at 1.3k context). So a decode step feeds the token just chosen
plus a few drafted ones; the model's own logits at each row say which drafts it would have picked
itself (kvrag.decode.static keeps them and serves the next steps from them). A draft the model would
not pick costs only its row: the answer is the model's own, token for token (greedy), and sampled
answers draw from the model's own distributions. (A row's logits differ from a one-row step's only in
the float order of the projections, one matrix product for all rows, as in batching: the tests and
`kvrag bench-decode` check that no answer changes.) The drafts come from the prompt and the answer so far,
never from another model, so nothing is learned or downloaded.

The lookup: the longest of the last 3, 2 or 1 tokens that occurred earlier (its latest occurrence) and
the tokens that followed it there. An index of n-grams makes each proposal O(1).
"""

from __future__ import annotations

from typing import Iterable

MAX_NGRAM = 3


class PromptLookup:
    """The token history (prompt, then answer) and what followed each n-gram's latest occurrence in it."""

    def __init__(self, context_ids: Iterable[int], max_ngram: int = MAX_NGRAM) -> None:
        self.max_ngram = max_ngram
        self.ids: list[int] = list(context_ids)
        # per n: the n-gram -> where the token after its latest occurrence sits in `ids`; built in bulk,
        # as `append` would build it token by token (later occurrences overwrite earlier ones): ~70 ms
        # for a 32k-token prompt on a 2-core CPU instead of ~110, once, at the first decode step
        ids, end = self.ids, len(self.ids)
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        for n in range(1, max_ngram + 1):
            self._after[n].update(zip(zip(*(ids[i : end - n + i] for i in range(n))), range(n, end)))

    def append(self, token: int) -> None:
        """Add the next token; the n-grams that ended just before it now have a continuation."""
        ids = self.ids
        ids.append(token)
        last = len(ids) - 1
        for n in range(1, min(self.max_ngram, last) + 1):
            self._after[n][tuple(ids[last - n : last])] = last

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching tail."""
        if k <= 0:
            return []
        ids = self.ids
        for n in range(min(self.max_ngram, len(ids)), 0, -1):
            at = self._after[n].get(tuple(ids[len(ids) - n :]))
            if at is not None:
                return ids[at : at + k]
        return []
