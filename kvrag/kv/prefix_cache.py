"""The exact prefix cache: a finished turn's KV (context + history + answer), kept in memory so a later
prompt that starts with the same tokens reads only the rest.

Entries are keyed by the token ids they hold and a signature of how their KV was computed: "exact"
for Full Attention (and contexts read whole), where the KV of any prefix of the ids is what Full
Attention computes for it, so a hit may stop anywhere; an approximate method's signature names the
method and its settings, and its entries hit only past the whole prompt they were computed with (that
state depended on the question: turn two continues it exactly as it was, never a cut of it).
Different chunk texts are different ids, so entries are never shared across them; each engine (one
model, one set of weights) has its own cache.

Lookup compares the prompt with every entry of its signature (a few dozen at most under the byte
bound), which costs microseconds beside a forward; vLLM's block hashes or SGLang's radix tree would
matter at thousands of entries. Least recently used entries go first when the bytes run out.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

if TYPE_CHECKING:  # numpy and torch load with the first use, not with this module (the CLI's parser imports it)
    import numpy as np
    import torch

    from kvrag.model.cache import KV, LayerStack

# the default bound: KVRAG_PREFIX_CACHE_MB, else this (about 20 conversations of 1.5k tokens on the
# bundled model in float32: 46 KB a token)
DEFAULT_PREFIX_CACHE_MB = 1024
EXACT = "exact"
T = TypeVar("T")


def default_prefix_cache_bytes() -> int:
    env = os.environ.get("KVRAG_PREFIX_CACHE_MB", "").strip()
    if env:
        try:
            return max(0, int(env)) * 2**20
        except ValueError:
            raise ValueError(f"KVRAG_PREFIX_CACHE_MB must be a whole number of megabytes, got {env!r}") from None
    return DEFAULT_PREFIX_CACHE_MB * 2**20


@dataclass
class PrefixEntry:
    ids: np.ndarray  # int64 token ids the KV holds, in order from position 0
    keys: torch.Tensor  # [layers, kv_heads, tokens, head_dim], rotated at their positions
    values: torch.Tensor
    signature: str
    min_hit: int  # a hit must cover at least this many tokens

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass
class PrefixHit:
    """The first `tokens` positions of a stored turn's KV (views: copy before writing)."""

    keys: torch.Tensor
    values: torch.Tensor
    tokens: int

    @property
    def stack(self) -> LayerStack:
        return self.keys[:, :, : self.tokens], self.values[:, :, : self.tokens]


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    stored: int = 0
    evicted: int = 0
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0
    by_signature: dict[str, int] = field(default_factory=dict)


def without_prefix_cache(fn: Callable[..., T]) -> Callable[..., T]:
    """For a measurement taking the engine first: its exact prefix cache paused throughout, so every
    run reads what its method reads (the same prompt asked twice would otherwise hit)."""

    @functools.wraps(fn)
    def measured(rag: Any, *args: Any, **kwargs: Any) -> T:
        cache = getattr(rag, "prefix_cache", None)
        if cache is None:
            return fn(rag, *args, **kwargs)
        with cache.paused():
            return fn(rag, *args, **kwargs)

    return measured


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids `a` and `b` share."""
    import numpy as np

    n = min(a.size, b.size)
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """Bounded in-memory LRU of finished turns' KV (see the module docstring); thread-safe."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = default_prefix_cache_bytes() if max_bytes is None else max(0, int(max_bytes))
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._next = 0
        self._bytes = 0
        self._lock = threading.Lock()
        self._paused = 0
        self.stats = PrefixCacheStats(max_bytes=self.max_bytes)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and not self._paused

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Neither read nor keep anything inside (benchmarks: every timed run of a method reads its
        whole prompt, as the method does, however often the same prompt comes)."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    def lookup(self, signature: str, ids: Sequence[int], floor: int = 0) -> PrefixHit | None:
        """The longest stored prefix of `ids` under `signature`, longer than `floor` tokens and leaving
        at least one token to read (its logits start the answer); None when there is none."""
        if not self.enabled:
            return None
        import numpy as np

        want = np.asarray(ids, dtype=np.int64)
        best: tuple[int, int] | None = None
        with self._lock:
            self.stats.lookups += 1
            for key, entry in self._entries.items():
                if entry.signature != signature:
                    continue
                n = min(common_prefix(entry.ids, want), want.size - 1)
                if n > floor and n >= entry.min_hit and (best is None or n > best[1]):
                    best = (key, n)
            if best is None:
                return None
            entry = self._entries[best[0]]
            self._entries.move_to_end(best[0])
            self.stats.hits += 1
            self.stats.hit_tokens += best[1]
            return PrefixHit(entry.keys, entry.values, best[1])

    def store(self, signature: str, ids: Sequence[int], kv: Sequence[KV], min_hit: int = 0) -> bool:
        """Keep a copy of the KV of `ids` (per-layer [1, kv_heads, >= len(ids), d]: the first len(ids)
        slots are taken). An entry these ids extend is replaced; one larger than the bound is not kept."""
        if not self.enabled or not ids:
            return False
        import numpy as np
        import torch

        n = len(ids)
        keys = torch.stack([k[0, :, :n] for k, _ in kv])
        values = torch.stack([v[0, :, :n] for _, v in kv])
        entry = PrefixEntry(np.asarray(ids, dtype=np.int64), keys, values, signature, min_hit)
        if entry.nbytes > self.max_bytes:
            return False
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.signature == signature and e.ids.size <= n
                        and common_prefix(e.ids, entry.ids) == e.ids.size]:
                self._drop(key)  # what the new entry holds already
            self._entries[self._next] = entry
            self._next += 1
            self._bytes += entry.nbytes
            self.stats.stored += 1
            while self._bytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))
                self.stats.evicted += 1
        return True

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def snapshot(self) -> PrefixCacheStats:
        """The counters now, with the entries and bytes held."""
        with self._lock:
            s = PrefixCacheStats(**{**self.stats.__dict__, "by_signature": {}})
            s.entries, s.bytes, s.max_bytes = len(self._entries), self._bytes, self.max_bytes
            for e in self._entries.values():
                s.by_signature[e.signature] = s.by_signature.get(e.signature, 0) + 1
            return s
