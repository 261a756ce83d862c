"""The demo's documents: the sample corpus at start-up and uploads, indexed and precomputed.

Everything here is bounded, because it runs on the server for whoever opens the page:

- chunks have at most `CHUNK_TOKENS` tokens (the model's tokenizer counts them);
- one upload may add at most `MAX_UPLOAD_TOKENS` tokens;
- the demo's KV is kept under `MAX_STORE_BYTES`, estimated as tokens x the model's KV bytes per token;
- KV is precomputed in batches of at most `BATCH_TOKENS` tokens, and the engine takes the model's
  lock per batch only, so answers (other sessions', or this one's next run) go between batches;
- the start-up ingest is done by one session; others carry on without waiting for it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import streamlit as st

from kvrag.demo.render import plain_label
from kvrag.demo.upload import MAX_UPLOAD_FILES, UploadError, load_uploads, save_upload, upload_chunks, validate_upload
from kvrag.ingest.documents import count_tokens
from kvrag.errors import KVRagError
from kvrag.types import Chunk

CHUNK_TOKENS = 256  # per chunk
MAX_UPLOAD_TOKENS = 20_000  # per uploaded file
MAX_STORE_BYTES = 2_000_000_000  # the demo's KV (sample corpus + uploads), estimated
BATCH_TOKENS = 2_048  # per precompute batch: how long answers may wait for the model


class BudgetError(UploadError):
    """An upload that would go over the demo's token or store-size caps."""


def kv_bytes_per_token(lm: Any) -> int:
    """Bytes one token's KV takes: keys and values, every layer and KV head, in the model's dtype."""
    cfg = lm.model.config
    layers = int(cfg.num_hidden_layers)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    itemsize = getattr(lm.dtype, "itemsize", None) or 4
    return 2 * layers * heads * head_dim * int(itemsize)


def chunk_tokens(chunks: Sequence[Chunk], tokenizer: Any) -> int:
    return sum(count_tokens(c.text, tokenizer) for c in chunks)


def check_upload_budget(new_tokens: int, stored_tokens: int, bytes_per_token: int,
                        max_upload_tokens: int = MAX_UPLOAD_TOKENS, max_store_bytes: int = MAX_STORE_BYTES) -> None:
    """Raise BudgetError if an upload of `new_tokens` is over the per-upload cap, or would take the
    demo's KV (`stored_tokens` already) over `max_store_bytes`."""
    if new_tokens > max_upload_tokens:
        raise BudgetError(f"the file is too long: {new_tokens:,} tokens, the limit is {max_upload_tokens:,} tokens per file")
    total = (stored_tokens + new_tokens) * bytes_per_token
    if total > max_store_bytes:
        raise BudgetError(
            f"the demo's KV store is full: this file would take it to about {total / 1e9:.2f} GB, "
            f"the limit is {max_store_bytes / 1e9:.2f} GB"
        )


def token_batches(chunks: Sequence[Chunk], tokenizer: Any, max_tokens: int = BATCH_TOKENS) -> list[list[Chunk]]:
    """Consecutive batches of at most `max_tokens` tokens (a chunk over it goes alone)."""
    batches: list[list[Chunk]] = []
    current: list[Chunk] = []
    size = 0
    for chunk in chunks:
        n = count_tokens(chunk.text, tokenizer)
        if current and size + n > max_tokens:
            batches.append(current)
            current, size = [], 0
        current.append(chunk)
        size += n
    if current:
        batches.append(current)
    return batches


def precompute_with_progress(rag: Any, chunks: Sequence[Chunk], bar: Any, what: str = "chunks",
                             max_batch_tokens: int = BATCH_TOKENS) -> int:
    """Precompute KV in batches of at most `max_batch_tokens` tokens, moving the progress bar after each.

    `rag.precompute` holds the model's lock for one batch only, so a question asked meanwhile
    waits for at most one batch. Returns how many caches were computed."""
    computed, done, n = 0, 0, len(chunks)
    for batch in token_batches(chunks, rag.lm.tokenizer, max_batch_tokens):
        report = rag.precompute(batch, progress=False)
        computed += report.computed
        done += len(batch)
        bar.progress(done / max(n, 1), text=f"precomputing KV: {done}/{n} {what}")
    return computed


def index_missing(index: Any, chunks: Sequence[Chunk]) -> int:
    """Add the chunks the index lacks (embedding is the slow part, so known ones are skipped)."""
    have = {c.id for c in index.get([c.id for c in chunks])}
    todo = [c for c in chunks if c.id not in have]
    if todo:
        index.add(todo)
    return len(todo)


def uploads_dir(folder: Path) -> Path:
    return folder / "uploads"


def warm_up(rag: Any, chunks: Sequence[Chunk], methods: Sequence[str]) -> None:
    """One small prefill per path, so the first question's TTFT is not paying one-off start-up costs."""
    if chunks:
        for method in methods:
            rag.prefill("Warm-up?", chunks=list(chunks), method=method)


@dataclass
class _IngestRegistry:
    """Which (folder, store) pairs hold the corpus already; the lock makes one session do the work."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    done: set[tuple[str, str]] = field(default_factory=set)


@st.cache_resource
def ingest_registry() -> _IngestRegistry:
    return _IngestRegistry()


def corpus_chunks(folder: Path, tokenizer: Any, sample: bool = True) -> list[Chunk]:
    """The sample corpus (`sample`) and every saved upload, chunked as the demo chunks them."""
    from kvrag.ingest.samples import sample_corpus_dir
    from kvrag.ingest.documents import load_documents

    samples = load_documents([sample_corpus_dir()], max_tokens=CHUNK_TOKENS, tokenizer=tokenizer) if sample else []
    return samples + load_uploads(uploads_dir(folder), max_tokens=CHUNK_TOKENS, tokenizer=tokenizer)


def ensure_ingested(rag: Any, index: Any, folder: Path, warm_methods: Sequence[str]) -> None:
    """Index and precompute earlier uploads once per (folder, store), and the sample corpus too when the
    index is empty: an index `kvrag ingest` or the quickstart filled is answered from as it is (its KV is
    in their store, which the demo reads), never ingested a second time.

    One session does it (with a progress bar); a session that finds it under way does not wait:
    it can answer already (a chunk whose KV is not stored yet is computed when needed)."""
    registry = ingest_registry()
    key = (str(folder), rag.store.url)
    if key in registry.done:
        return
    if not registry.lock.acquire(blocking=False):
        st.info("The sample corpus is being prepared in another session; answers may be slower until it is done.")
        return
    try:
        if key in registry.done:
            return
        held = len(index)
        chunks = corpus_chunks(folder, rag.lm.tokenizer, sample=held == 0)
        what = "the sample corpus" if held == 0 else f"the {held} indexed chunks"
        with st.status(f"Preparing {what} ...", expanded=True) as status:
            bar = st.progress(0.0, text="indexing chunks ...")
            added = index_missing(index, chunks)
            bar.progress(0.0, text=f"indexed {added} new chunks; precomputing KV ...")
            computed = precompute_with_progress(rag, chunks, bar)
            bar.progress(1.0, text="warming up the model ...")
            warm_up(rag, chunks[:2] or index.query("warm-up", k=2), warm_methods)
            status.update(
                label=f"Corpus ready: {held + added} chunks ({added} newly indexed, {computed} KV caches computed)",
                state="complete",
                expanded=False,
            )
        registry.done.add(key)
    finally:
        registry.lock.release()


def handle_uploads(files: Sequence[Any], rag: Any, index: Any, folder: Path) -> None:
    """Validate, check against the caps, save (under a content-hash name), index and precompute each new upload."""
    if not files:
        return
    if len(files) > MAX_UPLOAD_FILES:
        st.sidebar.error(f"At most {MAX_UPLOAD_FILES} files at a time; remove some and try again.")
        return
    seen: set[str] = st.session_state.setdefault("ingested_uploads", set())
    tokenizer = rag.lm.tokenizer
    per_token = kv_bytes_per_token(rag.lm)
    for f in files:
        name = plain_label(getattr(f, "name", "file"), 60) or "file"
        try:
            upload = validate_upload(f.name, f.getvalue())
        except UploadError as exc:
            st.sidebar.error(f"{name}: {exc}")
            continue
        if upload.digest in seen:
            continue
        path = uploads_dir(folder) / upload.file_name
        existed = path.exists()
        try:
            if not existed:
                stored = chunk_tokens(corpus_chunks(folder, tokenizer), tokenizer)
                new = count_tokens(upload.text, tokenizer)
                check_upload_budget(new, stored, per_token)
            path = save_upload(upload, uploads_dir(folder))
            chunks = upload_chunks(path, max_tokens=CHUNK_TOKENS, tokenizer=tokenizer)
            if not chunks:
                raise UploadError("no text to index in the file")
            index_missing(index, chunks)
            bar = st.sidebar.progress(0.0, text=f"{name}: precomputing KV ...")
            precompute_with_progress(rag, chunks, bar, what=f"chunks of {name}")
        except (UploadError, KVRagError, ValueError, OSError) as exc:
            if not existed:
                path.unlink(missing_ok=True)
            st.sidebar.error(f"{name}: could not be added ({exc})")
            continue
        seen.add(upload.digest)
        st.sidebar.success(f"{name}: added {len(chunks)} chunk(s)")
