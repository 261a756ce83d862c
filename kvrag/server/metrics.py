"""Prometheus metrics, one registry per app (so tests and several apps in a process never collide)."""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the /metrics route)

from kvrag.cache_backends.trust import unverified_counts
from kvrag.decode.batch import BatchStats
from kvrag.ingest.index_trust import unverified_index_count
from kvrag.kv.prefix_cache import PrefixCacheStats
from kvrag.server.gate import RequestGate
from kvrag.types import AnswerStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INDEX_STATES = ("ok", "unreachable", "mismatch", "off")  # as /health names them


def index_state_of(index: Any) -> str:
    """What `kvrag_index_state` shows for a retrieval index: off without one, else how its last call went
    (kvrag.ingest.retrieval.ChunkIndex.state). Read without calling the index: a frozen index server
    never stalls a scrape."""
    if index is None:
        return "off"
    state = getattr(index, "state", "ok")
    return state if state in INDEX_STATES else "ok"


class ServerMetrics:
    """What an operator watches: traffic by endpoint and status, TTFT, cache effectiveness, the queue."""

    def __init__(self, gate: RequestGate, batches: Callable[[], BatchStats] = BatchStats,
                 prefixes: Callable[[], PrefixCacheStats] = PrefixCacheStats, index_state: Callable[[], str] = lambda: "off") -> None:
        """`batches`: the batched decoder's counts so far (kvrag.decode.batch.decode_batch_stats);
        `prefixes`: the exact prefix cache's (kvrag.kv.prefix_cache.PrefixCache.snapshot); `index_state`:
        the retrieval index's state as of its last call (`index_state_of`)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.index_unavailable = Counter("kvrag_index_unavailable", "Requests refused with 503 index_unavailable: the "
                                         "retrieval index server did not answer (chat that retrieves, ingest, delete)", registry=r)
        state = Gauge("kvrag_index_state", "The retrieval index's state as of its last call (a request or a /health check): "
                      "1 for the current state, 0 for the others; off: no index (--no-retrieval)", ["state"], registry=r)
        for name in INDEX_STATES:
            state.labels(name).set_function(lambda name=name: float(index_state() == name))
        self.requests = Counter("kvrag_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("kvrag_ttft_seconds", "Engine time to first token (prefill), per answer", buckets=TTFT_BUCKETS, registry=r)
        self.queue_wait = Histogram("kvrag_queue_wait_seconds", "Time a request waited for an engine slot", buckets=TTFT_BUCKETS, registry=r)
        self.cache_hits = Counter("kvrag_cache_hits", "Chunk KV entries loaded from the store", registry=r)
        self.cache_misses = Counter("kvrag_cache_misses", "Chunk KV entries computed because the store lacked them", registry=r)
        self.bytes_loaded = Counter("kvrag_bytes_loaded", "Bytes of chunk KV loaded from the store", registry=r)
        self.recomputed = Counter("kvrag_recomputed_tokens", "Chunk tokens recomputed by the selected method", registry=r)
        self.generated = Counter("kvrag_generated_tokens", "Tokens generated", registry=r)
        self.drafts_served = Counter("kvrag_draft_tokens_served", "Tokens served from a prompt-lookup draft the model agreed "
                                     "with, without a forward of their own (kvrag.decode.draft)", registry=r)
        self.rejected = Counter("kvrag_rejected_busy", "Requests refused with 503 because the queue was full", registry=r)
        self.abandoned = Counter("kvrag_abandoned_requests", "Requests dropped because their client disconnected, by stage "
                                 "(queued: never started; prefilled: nothing decoded; decoding: stopped early)", ["stage"], registry=r)
        self.prefix_hit_tokens = Counter("kvrag_prefix_hit_tokens", "Prompt tokens read from the exact prefix cache (an "
                                         "earlier turn) instead of computed", registry=r)
        self.prefix_hits = Counter("kvrag_prefix_hits", "Answers that continued from the exact prefix cache", registry=r)
        for name, doc, read in (
            ("kvrag_prefix_cache_entries", "Finished turns held in the exact prefix cache", lambda: prefixes().entries),
            ("kvrag_prefix_cache_bytes", "Bytes of KV held in the exact prefix cache", lambda: prefixes().bytes),
            ("kvrag_prefix_cache_max_bytes", "The exact prefix cache's bound in bytes (0: off)", lambda: prefixes().max_bytes),
            ("kvrag_prefix_cache_evicted", "Entries the exact prefix cache dropped for room since start-up", lambda: prefixes().evicted),
            # a keyed store's reads it could not verify (no MAC, another key's): misses, kept (kvrag.cache_backends.trust)
            ("kvrag_store_unverified_entries", "Store entries read since start-up that $KVRAG_STORE_KEY could not verify "
             "(written without the key or with another): served as misses, never deleted", lambda: unverified_counts()["entries"]),
            ("kvrag_store_unverified_refs", "Id refs read since start-up that $KVRAG_STORE_KEY could not verify: "
             "those ids were misses, never served", lambda: unverified_counts()["refs"]),
            # a keyed index's entries whose MAC is missing or wrong (kvrag.ingest.index_trust): skipped, kept
            ("kvrag_index_unverified_entries", "Retrieval index entries read since start-up that $KVRAG_STORE_KEY could "
             "not verify (no MAC, another key's, or edited): skipped, never answered nor credited", unverified_index_count),
        ):
            Gauge(name, doc, registry=r).set_function(read)
        self.precomputed = Counter("kvrag_ingested_chunks", "Chunks ingested, by outcome", ["outcome"], registry=r)
        queue = Gauge("kvrag_queue_depth", "Requests waiting for an engine slot", registry=r)
        queue.set_function(lambda: gate.waiting)
        running = Gauge("kvrag_running_requests", "Requests holding an engine slot", registry=r)
        running.set_function(lambda: gate.running)
        # the batched decoder (kvrag.decode.batch): rows / steps is the mean batch size since start-up
        steps = Gauge("kvrag_decode_steps", "Decode forwards run by the batched decoder since start-up", registry=r)
        steps.set_function(lambda: batches().steps)
        rows = Gauge("kvrag_decode_rows", "Sequence-steps those forwards served (rows / steps: the mean batch size)", registry=r)
        rows.set_function(lambda: batches().rows)
        largest = Gauge("kvrag_decode_batch_largest", "The most sequences one decode forward has served", registry=r)
        largest.set_function(lambda: batches().largest)

    def observe_answer(self, stats: AnswerStats) -> None:
        """Count one finished (or abandoned) answer's stats."""
        self.ttft.observe(stats.ttft_s)
        self.cache_hits.inc(stats.cache_hits)
        self.cache_misses.inc(stats.cache_misses)
        self.bytes_loaded.inc(stats.bytes_loaded)
        self.recomputed.inc(stats.recomputed_tokens)
        self.generated.inc(stats.generated_tokens)
        self.drafts_served.inc(stats.draft_accepted)
        self.prefix_hit_tokens.inc(stats.prefix_hit_tokens)
        if stats.prefix_hit_tokens:
            self.prefix_hits.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
