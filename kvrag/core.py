"""The engine's API over its two rooms: a `KVRepository` (chunks and their KV) and a `RequestPipeline`.

`KVRagCore` is the engine without model preparation (adapters, the correctness gate): the gate
itself drives one to measure a model, and `KVRag` (kvrag.engine) adds both on top.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from kvrag.cache_backends import KVStore, open_store
from kvrag.kv.layout import PromptLayout, make_layout
from kvrag.kv.layout_options import LayoutOptions  # noqa: F401 (the layout parameter's type)
from kvrag.model.loading import LoadedModel, kvrag_home
from kvrag.kv.kinds import KIND_CHUNK
from kvrag.defaults import DEFAULT_RATIO, FIXED_DEFAULT, DefaultSetting
from kvrag.options import TUNED_METHOD, AnswerOptions
from kvrag.pipeline import AnswerStream, Prefill, RequestPipeline
from kvrag.kv.precompute import KVComputer
from kvrag.model.cache import LayerStack
from kvrag.ingest.prompt_match import match_conversation, match_prompt
from kvrag.kv.prefix_cache import PrefixCache
from kvrag.kv.repository import KVRepository, PrecomputeReport, Resolved
from kvrag.chat import Conversation
from kvrag.errors import StoreUnavailableError
from kvrag.model.rope import Rotary
from kvrag.fuse.stitch import Stitched
from kvrag.kv.layout import Segments
from kvrag.types import Answer, Chunk
from kvrag.link_adapter import LinkAdapter

log = logging.getLogger(__name__)


def default_index_texts(ids: Sequence[str]) -> list[Chunk]:
    """Chunks by id from the index `kvrag ingest` fills by default ($KVRAG_HOME/chroma); [] when there
    is none or it cannot be read (a lost entry is then ChunkNotFoundError, as it was)."""
    from kvrag.ingest.retrieval import ChunkIndex, indexed_count

    path = kvrag_home() / "chroma"
    try:
        if not indexed_count(path):
            return []
        return ChunkIndex(path).get(ids)
    except Exception as exc:  # noqa: BLE001 (a fallback: its failure leaves the id not found, never another error)
        log.warning("could not read chunk texts from the index %s: %s", path, exc)
        return []


class KVRagCore:
    """RAG over a local causal LM that reuses each chunk's precomputed KV cache (no gate, no adapter)."""

    def __init__(
        self,
        lm: LoadedModel,
        store: KVStore | str | None = None,
        layout: "PromptLayout | LayoutOptions | dict | str | None" = None,
        batch_size: int = 8,
        prefix_cache: PrefixCache | None = None,
        **layout_kwargs: Any,
    ) -> None:
        """`layout`: how the prompt is laid out (kvrag.kv.layout_options: LayoutOptions, a dict, a preset name,
        JSON text or a JSON file; None: the default), validated here. `prefix_cache`: where finished turns'
        KV is kept for the next turn (kvrag.kv.prefix_cache; default: a new one bounded by
        $KVRAG_PREFIX_CACHE_MB, 1 GiB; `PrefixCache(0)` keeps nothing)."""
        self.lm = lm
        self.layout = make_layout(lm.tokenizer, layout, **layout_kwargs)
        if store is None or isinstance(store, str):  # default: memory -> disk on CPU; GPU -> pinned host -> disk on CUDA
            store = open_store(store, default_root=kvrag_home() / "kv", device=lm.device)
        self.store: KVStore = store
        self.rotary = Rotary(lm.model)
        self.computer = KVComputer(lm, self.rotary)
        self.repo = KVRepository(lm, self.store, self.layout, self.computer, batch_size)
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self.pipeline = RequestPipeline(self.repo, self.rotary, lambda: self.link_adapter, self.prefix_cache)
        self.repo.text_source = default_index_texts

    def recover_from(self, index: Any) -> None:
        """Where the text of a chunk id whose KV entry is damaged or gone (a truncated file, a Redis that
        evicted it) is read back, so the answer by id still comes (its KV recomputed and stored again, the
        log naming the entry): `index`, a ChunkIndex holding the same chunks (or any callable from ids to
        chunks); None: nowhere (ChunkNotFoundError). Default: the index `kvrag ingest` fills under
        $KVRAG_HOME/chroma, when there is one. A text is taken only when it hashes to the entry the store
        links the id to."""
        self.repo.text_source = None if index is None else getattr(index, "get", index)

    @property
    def link_adapter(self) -> Any:
        """The KVLink adapter `method="kvlink"` uses (none here; `KVRag` resolves one)."""
        return None

    @property
    def default_setting(self) -> DefaultSetting:
        """The setting a request that names no method gets, and why (`KVRag` calibrates it per model)."""
        return FIXED_DEFAULT

    @property
    def default_method(self) -> str:
        """The method a request that names none gets (`default_setting`'s)."""
        return self.default_setting.method

    def _options(self, options: AnswerOptions | None, kwargs: dict[str, Any], fill: bool = True) -> AnswerOptions:
        """The request's options; `fill`: with the default setting where they name no method. `prefill` fills
        it only once the request's input is checked, so bad input fails at once, never after a calibration."""
        opts = AnswerOptions.from_kwargs(options, **kwargs)
        return opts if opts.method is not None or not fill else opts.with_default_method(self.default_setting)

    @property
    def batch_size(self) -> int:
        return self.repo.batch_size

    @property
    def _chunks(self) -> dict[str, Chunk]:
        return self.repo.chunks

    def _key(self, kind: str, token_ids: Sequence[int]) -> str:
        return self.repo.key(kind, token_ids)

    def _resolve(self, chunks: Sequence[Chunk], kind: str = KIND_CHUNK) -> Resolved:
        return self.repo.resolve(chunks, kind)

    # -- chunks -----------------------------------------------------------------------------------
    def prefix_kv(self) -> LayerStack:
        """The system prefix's KV, computed once per (model, system prompt) and kept in the store."""
        with self.lm.lock:
            return self.repo.prefix_kv()

    def register(self, chunks: Iterable[Chunk]) -> list[Chunk]:
        """Remember chunks by id (here and in the store's node-id index) so `answer(chunk_ids=...)` finds them."""
        return self.repo.register(chunks)

    def prefetch(self, chunk_ids: Sequence[str] | None = None, chunks: Sequence[Chunk] | None = None) -> None:
        """Start loading these chunks' KV (a tiered store loads in the background; others ignore it)."""
        self.repo.guarded.prefetch(self.repo.prefetch_keys(chunk_ids, chunks))

    def precompute(
        self,
        chunks: Iterable[Chunk],
        batch_size: int | None = None,
        progress: bool = True,
        kind: str = KIND_CHUNK,
        neighbours: Mapping[str, Sequence[str]] | None = None,
        top_n: int = 2,
        index: Any = None,
    ) -> PrecomputeReport:
        """Compute and store the KV of every chunk not cached yet (batched, with a progress bar).

        `kind="similarity"` stores FusionRAG's similarity-guided variant: each chunk's KV computed
        with its `top_n` most similar chunks before it (from `neighbours`, else `index`, else the
        embedding similarity among all chunks this engine knows). Answer with it via `kv_kind="similarity"`.
        """
        with self.lm.lock:
            return self.repo.precompute(chunks, batch_size, progress, kind, neighbours, top_n, index)

    def chunk(self, chunk_id: str) -> Chunk:
        """The chunk this id names now, as `answer(chunk_ids=[...])` would read it (see `KVRepository.chunk`):
        an id replaced or deleted through another process sharing the store is never its old text here."""
        return self.repo.chunk(chunk_id)

    def forget(self, chunks: Sequence[Chunk]) -> int:
        """Remove chunks: from the registry and their KV from the store (returns entries deleted).
        StoreUnavailableError, with nothing changed, while the store's id index cannot be read: the ids
        would stay bound there, answered by every other process sharing the store."""
        live = [c for c in chunks if c.text.strip()]
        self.check_links_readable([c.id for c in live])
        return self.repo.forget(self.repo.resolve(live))

    def check_links_readable(self, chunk_ids: Sequence[str]) -> None:
        """StoreUnavailableError when the store's node-id index (what every process sharing the store
        resolves ids through) cannot be read for these ids: a forget must then change nothing. A store
        that never fails to read its index (memory, disk) never raises."""
        if chunk_ids and self.repo.store_links(list(chunk_ids)) is None:
            raise StoreUnavailableError(
                "the KV store's id index cannot be read (is its Redis down?): nothing was forgotten; "
                "retry once the store is back")

    # -- answering --------------------------------------------------------------------------------
    def prefill(
        self,
        question: str | Conversation | None = None,
        chunk_ids: Sequence[str] | None = None,
        *,
        chunks: Sequence[Chunk] | None = None,
        messages: Any = None,
        options: AnswerOptions | None = None,
        allow_empty: bool = False,
        **kwargs: Any,
    ) -> Prefill:
        """Everything up to the first token's logits: load, stitch, select, recompute.

        `question` (one question), or `messages` (a conversation: see `chat`). `options` (or the
        same as keywords: method, recompute_ratio, kv_kind, evict, prefix_cache, and the method's own
        parameters). With `evict`, the question's queries are captured during the pass so the cache
        can be evicted after the first token (in `decode`).
        """
        conv = self._conversation(question, messages)
        if isinstance(chunk_ids, (str, bytes)):
            raise TypeError(f"chunk_ids must be a list of ids, not one string ({chunk_ids!r}): pass [{chunk_ids!r}]")
        opts = self._options(options, kwargs, fill=False)
        resolved = self.repo.lookup(chunk_ids, chunks, allow_empty)  # unknown ids, an empty retrieval: raised here
        if opts.method is None:  # checked: now the default (a first such request calibrates the model)
            opts = opts.with_default_method(self.default_setting)
        pre = self._prefill_resolved(conv, resolved, opts)
        pre.stats.default, pre.stats.default_reason = opts.default_note, opts.default_reason
        return pre

    @staticmethod
    def _conversation(question: str | Conversation | None, messages: Any) -> Conversation:
        if messages is not None:
            if question is not None:
                raise TypeError("pass either a question or messages=, not both")
            return Conversation.of(messages)
        if isinstance(question, Conversation):
            return question
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        return Conversation.ask(question)

    def _prefill_resolved(self, question: str | Conversation, resolved: Resolved, opts: AnswerOptions, documents: bool = True) -> Prefill:
        """`prefill` once the request's chunks are resolved (`KVRag` routes kvlink to its adapter's weights here)."""
        if opts.kv_kind == KIND_CHUNK and not opts.resolved_method().full_attention and not opts.whole_reason_for(resolved):
            self.repo.read_ahead(resolved)  # outside the model lock: see KVRepository.read_ahead
        return self.pipeline.prefill(question, resolved, opts, documents)

    def stitched(self, chunks: Sequence[Chunk], segments: Segments) -> Stitched:
        """The stitched context of `chunks` laid out as `segments` (store hits; misses computed and
        kept), as `prefill` builds it; KVLink training reads its context KV this way."""
        return self.pipeline.stitched(self.repo.resolve(chunks), segments)

    def stream(
        self,
        question: str,
        chunk_ids: Sequence[str] | None = None,
        *,
        chunks: Sequence[Chunk] | None = None,
        options: AnswerOptions | None = None,
        **kwargs: Any,
    ) -> AnswerStream:
        """Like `answer`, but returns an iterator of text pieces (stats complete at the end)."""
        opts = self._options(options, kwargs, fill=False)
        pre = self.prefill(question, chunk_ids, chunks=chunks, options=opts)
        return self.decode(pre, options=opts)

    def stream_chat(
        self,
        messages: Any,
        chunk_ids: Sequence[str] | None = None,
        *,
        chunks: Sequence[Chunk] | None = None,
        options: AnswerOptions | None = None,
        **kwargs: Any,
    ) -> AnswerStream:
        """Like `chat`, streaming: an iterator of text pieces (stats complete at the end)."""
        opts = self._options(options, kwargs, fill=False)
        conv = Conversation.of(messages)
        if chunk_ids is None and chunks is None:  # plain chat: the messages through the model's chat template
            resolved = self.repo.lookup(None, None, allow_empty=True)
            pre = self._prefill_resolved(conv, resolved, dataclasses.replace(opts, method="full"), documents=False)
            pre.stats.path = "plain"
        else:
            pre = self.prefill(conv, chunk_ids, chunks=chunks, options=opts)
        return self.decode(pre, options=opts)

    def chat(self, messages: Any, chunk_ids: Sequence[str] | None = None, **kwargs: Any) -> Answer:
        """Answer the last user message of a conversation from the given chunks.

        `messages`: OpenAI-style dicts (`{"role": "user", "content": ...}`), `(role, content)` pairs,
        LangChain or LlamaIndex message objects, or a `Conversation`. The prompt is the model's chat
        template over the engine's instruction and the caller's system text, the chunks at the head
        of the first user turn, then every turn; earlier turns and system text are read exactly,
        like the question. `method="full"` reads exactly what `tokenizer.apply_chat_template` gives
        for `layout.conversation_messages(chunks, conversation)`. A turn's KV is kept in the exact
        prefix cache, so the next turn over the same chunks reads only its new tokens
        (`stats.prefix_hit_tokens`; `prefix_cache=False` neither reads nor keeps it). With no
        chunk_ids or chunks: plain chat, the messages alone through the chat template.
        """
        return self.stream_chat(messages, chunk_ids, **kwargs).answer()

    def decode(self, pre: Prefill, *, options: AnswerOptions | None = None, **kwargs: Any) -> AnswerStream:
        """Decode from a prefill (what `stream` does after `prefill`); the benchmark calls the two apart.

        Decode settings (max_new_tokens, temperature, top_p, stop, seed) and `evict` come from
        `options` or keywords. `evict` (SnapKV) bounds the cache after the first token: the first
        token comes from the prefill's logits, every later one attends to the evicted cache.
        """
        opts = AnswerOptions.from_kwargs(options, **kwargs)  # decoding reads no method: the default is not resolved here
        return self.pipeline.decode(pre, opts.decode, opts.evict)

    def match_prompt(self, prompt: str) -> tuple[list[Chunk], str]:
        """Known chunks whose text appears verbatim in `prompt` (in prompt order) and the text after the last.

        This is how a drop-in LLM reuses cached chunks inside a prompt a framework built itself.
        """
        return match_prompt(prompt, list(self.repo.chunks.values()))

    def complete(self, prompt: str, *, options: AnswerOptions | None = None, **kwargs: Any) -> AnswerStream:
        """Answer a ready-made prompt (what a framework's LLM call receives): `complete_chat` over one
        user message. Known chunks found verbatim in it are reused (`stats.path == "prompt-match"`),
        the text after the last one is the question; with none, the prompt is read as the model reads
        any chat message, through its chat template (`stats.path == "plain"`)."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("prompt must be a non-empty string")
        return self.complete_chat([("user", prompt)], options=options, **kwargs)

    def complete_chat(self, messages: Any, *, options: AnswerOptions | None = None, **kwargs: Any) -> AnswerStream:
        """Answer messages a framework built itself (LangChain prompt templates, LlamaIndex chat
        engines): known chunks pasted into them are read from their cached KV and the message that
        wrapped them is left out (`kvrag.ingest.prompt_match.match_conversation`, `stats.path ==
        "prompt-match"`); with none, plain chat through the model's chat template ("plain")."""
        opts = self._options(options, kwargs, fill=False)
        conv = Conversation.of(messages)
        found, rest = match_conversation(conv, list(self.repo.chunks.values()))
        if not found:
            return self.stream_chat(conv, options=opts)
        pre = self.prefill(rest, chunks=found, options=opts)
        pre.stats.path = "prompt-match"
        return self.decode(pre, options=opts)

    def answer(self, question: str, chunk_ids: Sequence[str] | None = None, **kwargs: Any) -> Answer:
        """Answer `question` from the given chunks; `.stats` tells what it cost and which path it took."""
        return self.stream(question, chunk_ids, **kwargs).answer()

    @property
    def home(self) -> Path:
        return kvrag_home()


# -- kvlink's fast path over a link adapter's merged weights, beside a base engine (KVRag routes kvlink to it;
# calibration measures kvlink with it without an engine) ----------------------------------------------
ADAPTER_DEFAULT = DefaultSetting(TUNED_METHOD, DEFAULT_RATIO, "adapter", "a weight-changing link adapter was asked for")


class AdapterPath(KVRagCore):
    """kvlink's fast path over merged weights: the base engine's store, layout and chunk registry, and
    its own chunk KV (keys from the merged fingerprint), or, for a LoRA trained only at the positions
    after the chunks (mode lora-after), the base engine's chunk KV read by the merged weights."""

    def __init__(self, lm: LoadedModel, base: KVRagCore, adapter: LinkAdapter) -> None:
        super().__init__(lm, store=base.store, layout=base.layout, batch_size=base.batch_size)
        self.repo.chunks = base.repo.chunks  # one registry: ids registered through either path resolve in both
        self._adapter = adapter
        self.shares_chunks = adapter.reads_base_chunks
        if self.shares_chunks:  # the base weights encode (and key) the chunks; the merged ones read the prompt and decode
            self.repo = base.repo
            self.pipeline = RequestPipeline(base.repo, self.rotary, lambda: self.link_adapter, self.prefix_cache, lm=lm)

    @property
    def link_adapter(self) -> LinkAdapter:
        return self._adapter

    @property
    def default_setting(self) -> DefaultSetting:
        return ADAPTER_DEFAULT

    def rekey(self, resolved: Resolved) -> Resolved:
        """The base path's resolved chunks (ids looked up there, token ids known) keyed for these weights."""
        if self.shares_chunks:
            return resolved
        return Resolved(chunks=resolved.chunks, token_ids=resolved.token_ids, keys=[self.repo.chunk_key(ids, resolved.salt) for ids in resolved.token_ids],
                        whole=resolved.whole, salt=resolved.salt)
