"""kvrag's Streamlit demo: ask a question, watch a KV-reuse method answer next to Full Attention.

Run it with `kvrag demo` (or `streamlit run demos/streamlit_app.py` from a clone, or
`kvrag.demo.launch.launch()`); both serve 127.0.0.1 only unless told otherwise. On first start it
indexes the bundled sample corpus and precomputes its KV under `$KVRAG_DEMO_DIR` (default
`$KVRAG_HOME/demo`); later starts reuse it.

The page shows, for one question, the chosen method's answer and Full Attention's answer, each
streamed as plain text, their time-to-first-token and the speed-up, and the retrieved chunks with
the tokens the method recomputed highlighted. Its parts live in `kvrag.demo` (stores, rendering,
ingestion and its caps); uploads are checked in `kvrag.demo.upload`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from kvrag.eval.metrics import agreement, first_token_kl
from kvrag.options import RATIO_FREE
from kvrag.ingest.samples import sample_questions
from kvrag.quiet import quiet_libraries
from kvrag.demo.ingest import (  # noqa: F401  (re-exported for callers of the old single module)
    CHUNK_TOKENS,
    MAX_STORE_BYTES,
    MAX_UPLOAD_TOKENS,
    ensure_ingested,
    handle_uploads,
    index_missing,
    precompute_with_progress,
    uploads_dir,
)
from kvrag.demo.render import ChunkView, chunk_views, highlight_html, plain_label, show_answer, stream_answer, token_pieces  # noqa: F401
from kvrag.demo.stores import (  # noqa: F401
    ALLOW_HOSTS_ENV,
    DEMO_DIR_ENV,
    StoreUnreachable,
    check_store,
    check_store_url,
    data_dir,
    default_store_url,
    is_loopback_host,
    redact_url,
)
from kvrag.demo.upload import MAX_UPLOAD_BYTES, MAX_UPLOAD_FILES
from kvrag.errors import KVRagError
from kvrag.types import AnswerStats, Chunk

quiet_libraries()  # before the model/embedder imports below: offline, no progress bars

BASELINE = "full"
DEFAULT_RATIO = 0.15
DEFAULT_K = 5
DEFAULT_MAX_NEW_TOKENS = 48


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
def load_engine() -> Any:
    """The bundled model prepared once per server process (its shipped link embeddings, the gate passed),
    over a memory store; `open_engine` shares it with every store."""
    from kvrag.engine import KVRag

    return KVRag.from_pretrained(store="memory://")


@st.cache_resource(show_spinner="Opening the vector index ...")
def open_index(folder: str) -> Any:
    """The demo's embedded chroma index (one client per folder per process)."""
    from kvrag.ingest.retrieval import ChunkIndex

    return ChunkIndex(Path(folder) / "chroma", collection="kvrag_demo")


@st.cache_resource(show_spinner="Opening the KV store ...")
def open_engine(store_url: str) -> Any:
    """An engine over the shared model and the store at `store_url` (one per URL per process)."""
    from kvrag.cache_backends import open_store

    try:
        store = open_store(store_url)
    except Exception:  # a client library's message may carry what the server answered: not repeated
        raise StoreUnreachable(f"could not open the store at {redact_url(store_url)}") from None
    check_store(store)
    return load_engine().with_store(store)


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
    kl: float = 0.0  # first-token KL divergence of the method from Full Attention

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
                kl=float(data.get("kl", 0.0)),
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
    return f"{method}" + ("" if method in RATIO_FREE else f" (recompute {ratio:.0%})")


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
    text = stream_answer(stream)  # plain text: the model's Markdown, links and images are not rendered
    stats: AnswerStats = stream.stats
    st.metric("Time to first token", f"{stats.ttft_s * 1000:.0f} ms")
    st.caption(stats_caption(stats.as_dict()))
    return Side(method, text if isinstance(text, str) else stream.text, stats.as_dict()), pre


def show_side(side: Side, ratio: float) -> None:
    st.subheader(side_title(side.method, ratio))
    show_answer(side.text)
    st.metric("Time to first token", f"{side.stats['ttft_s'] * 1000:.0f} ms")
    st.caption(stats_caption(side.stats))


def show_speedup(result: Result) -> None:
    """The speed-up, and beside it how close the fast answer is to Full Attention's: a fast wrong
    answer is worth nothing, so the two are never shown apart."""
    method = result.sides[0].method
    same = agreement(result.sides[0].text, result.sides[1].text)
    speed, close, kl = st.columns(3)
    speed.metric(f"Speed-up in TTFT (Full ÷ {method})", f"{result.speedup:.1f}×")
    close.metric("Same answer as Full Attention", "yes" if same else "no")
    kl.metric("First-token KL from Full Attention", f"{result.kl:.3f}", help="0 means the first token's distribution is identical")


def show_chunks(result: Result) -> None:
    method = result.sides[0].method
    st.subheader("Retrieved chunks")
    if not any(v.recomputed for v in result.chunks):  # full reuse, kvlink: no chunk token recomputed
        st.caption(f"{method} recomputed none of these tokens: every chunk came from the precomputed KV cache.")
    else:
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
        full, full_pre = answer_side(rag, question, chunks, BASELINE, ratio, max_new)
    kl = first_token_kl(full_pre.logits, pre.logits)
    result = Result(question, [side, full], chunk_views(rag, pre), ratio, kl)
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
    default = load_engine().default_method  # DEFAULT_METHOD (kvlink only with a tuned adapter asked for)
    method = sb.selectbox("Method", names, index=names.index(default) if default in names else 0, key="method")
    sb.caption(method_summary(method))
    ratio = sb.slider("Recompute ratio", 0.0, 1.0, DEFAULT_RATIO, 0.01, key="ratio", disabled=method in RATIO_FREE,
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
    shown = redact_url(settings.store_url)
    try:
        check_store_url(settings.store_url, data_dir())  # our own checks: their messages are safe to show
    except ValueError as exc:
        st.error(f"Cannot use the KV store {shown!r}: {exc}")
        st.stop()
    try:
        return open_engine(settings.store_url)
    except (StoreUnreachable, KVRagError) as exc:  # messages of our own, with the URL redacted
        st.error(f"Cannot use the KV store {shown!r}: {exc}")
    except Exception:  # nothing a client library or the server said is repeated on the page
        st.error(f"Cannot use the KV store {shown!r}: could not connect to the store at {shown}")
    st.stop()


def warn_if_exposed() -> None:
    """Say so when the server listens beyond this machine (`kvrag demo` and the script's config bind 127.0.0.1)."""
    address = st.get_option("server.address")
    if address and not is_loopback_host(str(address)):
        st.warning(
            f"This demo is served on {plain_label(str(address), 60)}, not only on this machine: anyone who can reach it "
            "can run the model and add documents. Use `kvrag demo` or --server.address 127.0.0.1 to keep it local."
        )


def main() -> None:
    st.set_page_config(page_title="kvrag demo", layout="wide")
    st.title("kvrag: RAG answers from reused KV caches")
    st.caption(
        "Each retrieved chunk's KV cache was computed once and stored; a method stitches the cached chunks "
        "together and recomputes only a few tokens. Full Attention reads every chunk again, for comparison."
    )
    warn_if_exposed()
    folder = data_dir()
    settings = sidebar_settings(folder)
    rag = open_or_stop(settings)
    index = open_index(str(folder))
    ensure_ingested(rag, index, folder, warm_methods=(BASELINE, "reuse", rag.default_method))

    st.sidebar.header("Add documents")
    files = st.sidebar.file_uploader(
        f".txt or .md, UTF-8, up to {MAX_UPLOAD_BYTES // 1_000_000} MB and {MAX_UPLOAD_TOKENS:,} tokens each "
        f"({MAX_UPLOAD_FILES} files at most)",
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
