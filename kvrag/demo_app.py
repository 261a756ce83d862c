"""kvrag's Streamlit demo: ask a question, watch a KV-reuse method answer next to Full Attention.

Run it with `streamlit run kvrag/demo_app.py` (or `streamlit run demos/streamlit_app.py` from a
clone, or `kvrag.demo_launch.launch()`). On first start it indexes the bundled sample corpus and
precomputes its KV under `$KVRAG_DEMO_DIR` (default `$KVRAG_HOME/demo`); later starts reuse it.

The page shows, for one question, the chosen method's answer and Full Attention's answer, each
streamed, their time-to-first-token and the speed-up, and the retrieved chunks with the tokens
the method recomputed highlighted. Everything from users (uploads, chunk titles, model output)
is escaped before it reaches HTML; uploads are checked in `kvrag.demo_upload`.
"""

from __future__ import annotations

import html
import os
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import parse_qs, urlparse, urlunparse

import streamlit as st

from kvrag.cli import _quiet_libraries, sample_corpus_dir, sample_questions
from kvrag.demo_upload import MAX_UPLOAD_BYTES, MAX_UPLOAD_FILES, UploadError, load_uploads, save_upload, upload_chunks, validate_upload
from kvrag.errors import KVRagError
from kvrag.model import kvrag_home
from kvrag.types import AnswerStats, Chunk

_quiet_libraries()  # before the model/embedder imports below: offline, no progress bars

BASELINE = "full"
DEFAULT_METHOD = "cacheblend"
DEFAULT_RATIO = 0.15
DEFAULT_K = 5
DEFAULT_MAX_NEW_TOKENS = 48
PRECOMPUTE_BATCH = 8
DEMO_DIR_ENV = "KVRAG_DEMO_DIR"


# -- places ---------------------------------------------------------------------------------------
def data_dir() -> Path:
    """Where the demo keeps its index, KV store and uploads: $KVRAG_DEMO_DIR or $KVRAG_HOME/demo."""
    raw = os.environ.get(DEMO_DIR_ENV)
    return (Path(raw).expanduser() if raw else kvrag_home() / "demo").resolve()


def default_store_url(folder: Path) -> str:
    """A disk store inside the demo folder, so the demo never touches the CLI's default store."""
    return f"disk://{(folder / 'kv').resolve()}"


def redact_url(url: str) -> str:
    """The URL with any password replaced, for showing on the page."""
    try:
        parsed = urlparse(url)
        if parsed.password:
            netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@", 1)
            return urlunparse(parsed._replace(netloc=netloc))
    except ValueError:
        pass
    return url


def check_store_url(url: str, folder: Path) -> None:
    """Refuse a disk store outside the demo folder: the URL is typed by whoever opens the page.

    Redis and memory stores are allowed as they are; a tiered store is checked through its lower tier.
    """
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme == "disk":
        path = Path(parsed.netloc + parsed.path).expanduser().resolve()
        if not path.is_relative_to(folder.resolve()):
            raise ValueError(f"a disk store must be inside the demo folder {folder} (set {DEMO_DIR_ENV} to move it)")
    elif scheme == "tiered":
        lower = parse_qs(parsed.query).get("lower", [""])[0]
        if lower:
            check_store_url(lower, folder)


def plain_label(text: str, limit: int = 80) -> str:
    """Text safe to put in a Streamlit markdown label: letters, digits and simple punctuation only."""
    cleaned = re.sub(r"[^\w .,:;!?()'/-]+", " ", text or "", flags=re.UNICODE)
    cleaned = " ".join(cleaned.split())
    return cleaned[:limit] + ("..." if len(cleaned) > limit else "")


# -- methods --------------------------------------------------------------------------------------
def method_names() -> list[str]:
    """The selectable methods: every registered one except the Full Attention baseline shown beside it."""
    from kvrag.methods import METHODS

    return sorted(name for name in METHODS if name != BASELINE)


def method_summary(name: str) -> str:
    """First line of the method's docstring, for a caption under the selectbox."""
    from kvrag.methods import METHODS

    cls = METHODS.get(name)
    return (cls.__doc__ or "").strip().splitlines()[0] if cls and cls.__doc__ else ""


# -- cached resources -----------------------------------------------------------------------------
@st.cache_resource(show_spinner="Loading the model ...")
def load_lm() -> Any:
    """The bundled model, loaded once per server process and shared by every session and store."""
    from kvrag.model import load_model

    return load_model()


@st.cache_resource(show_spinner="Opening the vector index ...")
def open_index(folder: str) -> Any:
    """The demo's embedded chroma index (one client per folder per process)."""
    from kvrag.retrieval import ChunkIndex

    return ChunkIndex(Path(folder) / "chroma", collection="kvrag_demo")


def check_store(store: Any) -> None:
    """Fail now, with a clear message, if a networked store (Redis, or under a tiered one) is unreachable.

    The engine treats a down Redis as a cache miss by design, which would hide a mistyped URL.
    """
    from kvrag.cache_backends import StoreError

    for s in (store, getattr(store, "lower", None)):
        client = getattr(s, "client", None)
        if client is None or not hasattr(client, "ping"):
            continue
        try:
            client.ping()
        except Exception as exc:
            raise StoreError(f"cannot reach {redact_url(getattr(s, 'url', '?'))}: {exc}") from None


@st.cache_resource(show_spinner="Opening the KV store ...")
def open_engine(store_url: str) -> Any:
    """An engine over the shared model and the store at `store_url` (one per URL per process)."""
    from kvrag.cache_backends import open_store
    from kvrag.engine import KVRag

    store = open_store(store_url)
    check_store(store)
    return KVRag(load_lm(), store=store)


@dataclass
class _IngestRegistry:
    """Which (folder, store) pairs hold the corpus already; the lock makes one session do the work."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    done: set[tuple[str, str]] = field(default_factory=set)


@st.cache_resource
def ingest_registry() -> _IngestRegistry:
    return _IngestRegistry()


# -- ingestion ------------------------------------------------------------------------------------
def uploads_dir(folder: Path) -> Path:
    return folder / "uploads"


def index_missing(index: Any, chunks: Sequence[Chunk]) -> int:
    """Add the chunks the index lacks (embedding is the slow part, so known ones are skipped)."""
    have = {c.id for c in index.get([c.id for c in chunks])}
    todo = [c for c in chunks if c.id not in have]
    if todo:
        index.add(todo)
    return len(todo)


def precompute_with_progress(rag: Any, chunks: Sequence[Chunk], bar: Any, what: str = "chunks") -> int:
    """Precompute KV in small batches so the progress bar moves; returns how many were computed."""
    computed, n = 0, len(chunks)
    for start in range(0, n, PRECOMPUTE_BATCH):
        report = rag.precompute(chunks[start : start + PRECOMPUTE_BATCH], progress=False)
        computed += report.computed
        done = min(n, start + PRECOMPUTE_BATCH)
        bar.progress(done / n, text=f"precomputing KV: {done}/{n} {what}")
    return computed


def warm_up(rag: Any, chunks: Sequence[Chunk]) -> None:
    """One small prefill per path, so the first question's TTFT is not paying one-off start-up costs."""
    if chunks:
        for method in (BASELINE, "reuse", DEFAULT_METHOD):
            rag.prefill("Warm-up?", chunks=list(chunks), method=method)


def ensure_ingested(rag: Any, index: Any, folder: Path) -> None:
    """Index and precompute the sample corpus and earlier uploads once per (folder, store)."""
    from kvrag.documents import load_documents

    registry = ingest_registry()
    key = (str(folder), rag.store.url)
    if key in registry.done:
        return
    with registry.lock:
        if key in registry.done:
            return
        chunks = load_documents([sample_corpus_dir()]) + load_uploads(uploads_dir(folder))
        with st.status(f"Preparing the sample corpus ({len(chunks)} chunks) ...", expanded=True) as status:
            bar = st.progress(0.0, text="indexing chunks ...")
            added = index_missing(index, chunks)
            bar.progress(0.0, text=f"indexed {added} new chunks; precomputing KV ...")
            computed = precompute_with_progress(rag, chunks, bar)
            bar.progress(1.0, text="warming up the model ...")
            warm_up(rag, chunks[:2])
            status.update(
                label=f"Corpus ready: {len(chunks)} chunks ({added} newly indexed, {computed} KV caches computed)",
                state="complete",
                expanded=False,
            )
        registry.done.add(key)


def handle_uploads(files: Sequence[Any], rag: Any, index: Any, folder: Path) -> None:
    """Validate, save (under a content-hash name), index and precompute each new upload."""
    if not files:
        return
    if len(files) > MAX_UPLOAD_FILES:
        st.sidebar.error(f"At most {MAX_UPLOAD_FILES} files at a time; remove some and try again.")
        return
    seen: set[str] = st.session_state.setdefault("ingested_uploads", set())
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
            path = save_upload(upload, uploads_dir(folder))
            chunks = upload_chunks(path)
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


# -- highlighting ---------------------------------------------------------------------------------
def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[tuple[int, int, str]]:
    """(first, end, text) for runs of tokens that decode to whole characters, in order.

    Tokens are decoded cumulatively, so a character split across byte-level tokens is shown once,
    attached to the run of tokens that completes it, instead of as replacement characters.
    """
    pieces: list[tuple[int, int, str]] = []
    emitted, first = "", 0
    for i in range(len(ids)):
        text = tokenizer.decode(list(ids[: i + 1]), skip_special_tokens=False)
        if text.endswith("\ufffd") and i + 1 < len(ids):
            continue  # an incomplete character: wait for the token that finishes it
        if text.startswith(emitted):
            pieces.append((first, i + 1, text[len(emitted) :]))
        else:  # decoding is not prefix-stable here; fall back to this token on its own
            pieces.append((first, i + 1, tokenizer.decode([ids[i]], skip_special_tokens=False)))
        emitted, first = text, i + 1
    return pieces


def highlight_html(pieces: Sequence[tuple[int, int, str]], start: int, selected: set[int], kept: set[int] | None) -> str:
    """Escaped HTML of one chunk: recomputed tokens in <mark>, tokens a sparse method dropped in <s>.

    Neighbouring pieces of the same kind share one tag, which keeps the page small.
    """
    runs: list[tuple[str, str]] = []  # (kind, escaped text)
    for first, end, text in pieces:
        positions = range(start + first, start + end)
        if any(p in selected for p in positions):
            kind = "mark"
        elif kept is not None and not any(p in kept for p in positions):
            kind = "dropped"
        else:
            kind = ""
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1] + html.escape(text))
        else:
            runs.append((kind, html.escape(text)))
    tags = {"mark": ("<mark>", "</mark>"), "dropped": ('<s style="opacity:0.45">', "</s>"), "": ("", "")}
    body = "".join(tags[kind][0] + text + tags[kind][1] for kind, text in runs)
    return '<div style="white-space:pre-wrap;font-size:0.88em;line-height:1.5">' + body + "</div>"


@dataclass
class ChunkView:
    """One retrieved chunk as shown on the page (plain data: it is kept in session state)."""

    label: str
    html: str
    tokens: int
    recomputed: int


def chunk_views(rag: Any, pre: Any) -> list[ChunkView]:
    """Each retrieved chunk of a prefill with its recomputed tokens (`pre.selected`, global positions) marked."""
    selected = {int(p) for p in pre.selected.tolist()}
    stitched = getattr(pre, "stitched", None)
    kept = {int(p) for p in stitched.positions.tolist()} if stitched is not None and pre.stats.kept_kv_ratio < 1.0 else None
    views = []
    for i, (start, ids) in enumerate(zip(pre.segments.chunk_starts, pre.segments.chunks)):
        chunk = pre.chunks[i] if i < len(pre.chunks) else None
        n_sel = sum(1 for p in range(start, start + len(ids)) if p in selected)
        title = plain_label(chunk.title if chunk and chunk.title else (chunk.id if chunk else f"chunk {i + 1}"), 60)
        views.append(
            ChunkView(
                label=f"{i + 1}. {title}: {n_sel}/{len(ids)} tokens recomputed",
                html=highlight_html(token_pieces(rag.lm.tokenizer, ids), start, selected, kept),
                tokens=len(ids),
                recomputed=n_sel,
            )
        )
    return views


# -- answering ------------------------------------------------------------------------------------
@dataclass
class Side:
    """One column's answer."""

    method: str
    text: str
    stats: dict[str, Any]


@dataclass
class Result:
    """Everything one question put on the page, kept so a rerun (e.g. moving a slider) still shows it."""

    question: str
    sides: list[Side]
    chunks: list[ChunkView]
    ratio: float

    def to_state(self) -> dict[str, Any]:
        """Plain dicts for session state: a rerun re-executes this script, so its classes are new objects."""
        return asdict(self)

    @classmethod
    def from_state(cls, data: Any) -> "Result | None":
        """Rebuild a result kept by `to_state` (None if the state holds something else)."""
        try:
            return cls(
                question=data["question"],
                sides=[Side(**s) for s in data["sides"]],
                chunks=[ChunkView(**c) for c in data["chunks"]],
                ratio=data["ratio"],
            )
        except (KeyError, TypeError):
            return None

    @property
    def speedup(self) -> float:
        method, full = self.sides[0].stats["ttft_s"], self.sides[1].stats["ttft_s"]
        return full / max(method, 1e-9)


def side_title(method: str, ratio: float) -> str:
    if method == BASELINE:
        return "Full Attention (full)"
    return f"{method}" + ("" if method == "reuse" else f" (recompute {ratio:.0%})")


def stats_caption(stats: dict[str, Any]) -> str:
    return (
        f"{stats['prompt_tokens']} prompt tokens, {stats['recomputed_tokens']} recomputed, "
        f"cache hits {stats['cache_hits']} / misses {stats['cache_misses']}, "
        f"{stats['generated_tokens']} tokens generated"
    )


def answer_side(rag: Any, question: str, chunks: list[Chunk], method: str, ratio: float, max_new: int) -> tuple[Side, Any]:
    """Prefill, then stream the answer into the current container; the prefill is returned for highlighting."""
    st.subheader(side_title(method, ratio))
    pre = rag.prefill(question, chunks=chunks, method=method, recompute_ratio=ratio)
    stream = rag.decode(pre, max_new_tokens=max_new)
    text = st.write_stream(stream)
    stats: AnswerStats = stream.stats
    st.metric("Time to first token", f"{stats.ttft_s * 1000:.0f} ms")
    st.caption(stats_caption(stats.as_dict()))
    return Side(method, text if isinstance(text, str) else stream.text, stats.as_dict()), pre


def show_side(side: Side, ratio: float) -> None:
    st.subheader(side_title(side.method, ratio))
    st.markdown(side.text or "_(empty answer)_")
    st.metric("Time to first token", f"{side.stats['ttft_s'] * 1000:.0f} ms")
    st.caption(stats_caption(side.stats))


def show_speedup(result: Result) -> None:
    method = result.sides[0].method
    st.metric(f"Speed-up in TTFT (Full ÷ {method})", f"{result.speedup:.1f}×")


def show_chunks(result: Result) -> None:
    method = result.sides[0].method
    st.subheader("Retrieved chunks")
    st.caption(
        f"Highlighted: the tokens {method} recomputed; the rest came from the precomputed KV cache"
        + (" (struck-through tokens were dropped from the cache)" if method == "samkv" else "")
        + "."
    )
    # open the best-ranked chunk that has something highlighted (the first one if none has)
    opened = next((i for i, v in enumerate(result.chunks) if v.recomputed), 0)
    for i, view in enumerate(result.chunks):
        with st.expander(view.label, expanded=i == opened):
            st.markdown(view.html, unsafe_allow_html=True)  # built from html.escape'd text only


def ask(rag: Any, index: Any, question: str, method: str, ratio: float, top_k: int, max_new: int) -> Result | None:
    """Retrieve, answer with `method` and with Full Attention side by side, and return what was shown."""
    chunks = index.query(question, k=top_k)
    if not chunks:
        st.error("Nothing is indexed yet, so there is nothing to answer from.")
        return None
    left, right = st.columns(2)
    with left:
        side, pre = answer_side(rag, question, chunks, method, ratio, max_new)
    with right:
        full, _ = answer_side(rag, question, chunks, BASELINE, ratio, max_new)
    result = Result(question, [side, full], chunk_views(rag, pre), ratio)
    show_speedup(result)
    show_chunks(result)
    return result


def show_result(result: Result) -> None:
    """Redraw the last answer after a rerun, without recomputing it."""
    st.caption(f"Last question: {plain_label(result.question, 200)}")
    left, right = st.columns(2)
    with left:
        show_side(result.sides[0], result.ratio)
    with right:
        show_side(result.sides[1], result.ratio)
    show_speedup(result)
    show_chunks(result)


# -- page -----------------------------------------------------------------------------------------
@dataclass
class Settings:
    method: str
    ratio: float
    top_k: int
    max_new: int
    store_url: str


def sidebar_settings(folder: Path) -> Settings:
    names = method_names()
    sb = st.sidebar
    sb.header("Settings")
    method = sb.selectbox("Method", names, index=names.index(DEFAULT_METHOD) if DEFAULT_METHOD in names else 0, key="method")
    sb.caption(method_summary(method))
    ratio = sb.slider("Recompute ratio", 0.0, 1.0, DEFAULT_RATIO, 0.01, key="ratio", disabled=method == "reuse",
                      help="share of the retrieved chunks' tokens the method recomputes")
    top_k = sb.slider("Chunks to retrieve (top-k)", 1, 10, DEFAULT_K, key="top_k")
    max_new = sb.slider("Max new tokens", 8, 256, DEFAULT_MAX_NEW_TOKENS, 8, key="max_new")
    store_url = sb.text_input(
        "KV store URL", value=default_store_url(folder), key="store_url",
        help="disk:///path, memory://, redis://host:6379/0 or tiered://?lower=...",
    ).strip()
    return Settings(method, ratio, top_k, max_new, store_url or default_store_url(folder))


def show_store(rag: Any) -> None:
    """The store in use and its hit/miss counters since this server started."""
    sb = st.sidebar
    sb.header("KV store")
    sb.code(redact_url(rag.store.url), language=None)
    try:
        stats = rag.store.stats()
    except Exception as exc:  # a store fault must not break the page
        sb.warning(f"store statistics unavailable: {exc}")
        return
    sb.caption("lookups in this store since the server started")
    hits, misses = sb.columns(2)
    hits.metric("Cache hits", stats.hits)
    misses.metric("Cache misses", stats.misses)


def open_or_stop(settings: Settings) -> Any:
    """The engine for the chosen store, or a clear error (never a traceback) and the end of this run."""
    try:
        check_store_url(settings.store_url, data_dir())
        return open_engine(settings.store_url)
    except (KVRagError, ValueError) as exc:
        st.error(f"Cannot use the KV store {redact_url(settings.store_url)!r}: {exc}")
    except Exception as exc:  # a bad URL can fail inside a client library in many ways
        st.error(f"Cannot use the KV store {redact_url(settings.store_url)!r}: {type(exc).__name__}: {exc}")
    st.stop()


def main() -> None:
    st.set_page_config(page_title="kvrag demo", layout="wide")
    st.title("kvrag: RAG answers from reused KV caches")
    st.caption(
        "Each retrieved chunk's KV cache was computed once and stored; a method stitches the cached chunks "
        "together and recomputes only a few tokens. Full Attention reads every chunk again, for comparison."
    )
    folder = data_dir()
    settings = sidebar_settings(folder)
    rag = open_or_stop(settings)
    index = open_index(str(folder))
    ensure_ingested(rag, index, folder)

    st.sidebar.header("Add documents")
    files = st.sidebar.file_uploader(
        f".txt or .md, UTF-8, up to {MAX_UPLOAD_BYTES // 1_000_000} MB each ({MAX_UPLOAD_FILES} files at most)",
        type=["txt", "md"],
        accept_multiple_files=True,
        max_upload_size=max(1, MAX_UPLOAD_BYTES // 1_000_000),
        key="uploads",
    )
    handle_uploads(files or [], rag, index, folder)

    question = st.text_input("Question", value=sample_questions()[0]["question"], key="question")
    if st.button("Ask", type="primary", key="ask"):
        if not question.strip():
            st.error("Type a question first.")
        else:
            try:
                result = ask(rag, index, question.strip(), settings.method, settings.ratio, settings.top_k, settings.max_new)
            except (KVRagError, ValueError, TypeError) as exc:
                st.error(f"Could not answer: {exc}")
                result = None
            if result is not None:
                st.session_state["last_result"] = result.to_state()
    elif (last := Result.from_state(st.session_state.get("last_result"))) is not None:
        show_result(last)
    show_store(rag)


if __name__ == "__main__":
    main()
