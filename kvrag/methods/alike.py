"""Are these chunks records of one kind, and which record does the question name? Text only, cheap
enough to ask on every answer.

Why: where the retrieved documents are records written to one pattern ("The length of the X River is
... km." six times over, with other names and numbers), each chunk's KV was computed alone and looks to
the question like every other, and reuse takes the value from the wrong record. So such chunks are
read whole by default (AnswerOptions.records_whole), at a cost other documents need not pay; and
`whole_chunks=1` recomputes the record the question names (`named_by`). Records of one kind repeat
short phrases across chunks; natural passages rarely do; chunks cut from one text with overlapping
windows repeat long runs, which is copying, not a pattern.

Thresholds were set on training rows only, over each chunk's title and text (README, Results): the
median share of a chunk's word 3-grams found in another chunk was 0.23-0.61 on 200 six-record fact
rows (seed 2), at most 0.03 on the 1,200 NQ training rows (0-1199) and 0.00 on key-value rows (0-199);
of word 8-grams, at most 0.10 on the records and at least 0.39 on MuSiQue rows 0-99, whose passages
are overlapping windows. On rows never looked at (NQ 1200-1599, MuSiQue 100-149, key-value 200-299)
no request trips the test; on fresh six- and eight-record fact rows every one does.
"""

from __future__ import annotations

import functools
import math
import re
import statistics
from collections import Counter
from typing import Sequence

PATTERN_SHARE = 0.15  # at least this median share of word 3-grams found in another chunk: a shared pattern
COPY_SHARE = 0.25  # at least this median share of word 8-grams found in another chunk: copied text, not a pattern

_WORD = re.compile(r"\w+")


def shared_share(texts: Sequence[str], n: int) -> float:
    """Median over chunks of the share of a chunk's distinct word n-grams that another chunk also holds."""
    return _shared([_words(t) for t in texts], n)


def records_of_one_kind(texts: Sequence[str]) -> bool:
    """Whether the chunks share a pattern (many short phrases in common) without copying each other.
    Asked once a request: remembered for recent contexts (a server sees the same retrievals again)."""
    return len(texts) > 1 and _records_of_one_kind(tuple(texts))


@functools.lru_cache(maxsize=256)
def _records_of_one_kind(texts: tuple[str, ...]) -> bool:
    words = [_words(t) for t in texts]  # once for both tests; natural passages stop at the first
    return _shared(words, 3) >= PATTERN_SHARE and _shared(words, 8) < COPY_SHARE


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _shared(words: Sequence[list[str]], n: int) -> float:
    grams = [{tuple(w[i : i + n]) for i in range(len(w) - n + 1)} for w in words]
    seen_in = Counter(g for chunk in grams for g in chunk)
    shares = [sum(seen_in[g] > 1 for g in chunk) / len(chunk) for chunk in grams if chunk]
    return statistics.median(shares) if len(shares) > 1 else 0.0


def named_by(question: str, texts: Sequence[str]) -> list[float]:
    """How strongly the question names each chunk: the summed rarity, log(chunks / chunks holding it),
    of the question's words found in it. A word every chunk holds ("weight", "lamp") counts for none;
    the record's own name counts most, so among records of one kind the one asked about comes first."""
    words = [set(_words(t)) for t in texts]
    held_by = Counter(w for chunk in words for w in chunk)
    asked = set(_words(question))
    n = len(texts)
    return [sum(math.log(n / held_by[w]) for w in asked & chunk) for chunk in words]
