"""kvrag's Streamlit demo: a chat over your documents, answered from reused KV caches, with Full
Attention's answer to the same conversation beside each turn.

Run it with `kvrag demo` (or `streamlit run demos/streamlit_app.py` from a clone, or
`kvrag.demo.launch.launch()`); both serve 127.0.0.1 only unless told otherwise. It answers from
the index and the KV store `kvrag ingest` and `kvrag quickstart` fill (`$KVRAG_HOME/chroma`,
`$KVRAG_HOME/kv`): what they computed is read, not computed again. Only when that index is empty does
it ingest the bundled sample corpus there; uploads are kept under `$KVRAG_DEMO_DIR` (default
`$KVRAG_HOME/demo`).

Each turn retrieves with the conversation's recent questions (`Conversation.retrieval_query`) and
answers the whole conversation with the chosen method, streamed as plain text, with the exact
prefix cache on (turn two reads only its new tokens). Beside the answer: its TTFT, Full Attention's
over the same conversation and chunks (prefix cache off), the speed-up with the answers' agreement and
first-token KL, the prefix-cache hit, and the retrieved chunks with the tokens the method recomputed
highlighted; an answer the read-whole policy gave to Full Attention says so and highlights nothing.
The conversation is kept per browser session. Its parts live in `kvrag.demo` (stores, rendering,
ingestion and its caps); uploads are checked in `kvrag.demo.upload`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from kvrag.chat import Conversation
from kvrag.defaults import kvrag_home
from kvrag.eval.metrics import agreement, first_token_kl
from kvrag.ingest.follow_up import keep_order
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
from kvrag.demo.render import (  # noqa: F401
    BASELINE,
    ChunkView,
    chunk_views,
    chunks_caption,
    counts_line,
    highlight_html,
    method_line,
    plain_label,
    prefix_line,
    short_name,
    speed_source,
    show_answer,
    stream_answer,
    token_pieces,
)
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

DEFAULT_RATIO = 0.15
DEFAULT_K = 5
DEFAULT_MAX_NEW_TOKENS = 48


# -- methods --------------------------------------------------------------------------------------
DEFAULT_CHOICE = "default"  # the picker's first entry: what a request that names no method gets (calibrated per model)


def method_names() -> list[str]:
    """The selectable settings: the default first, then every registered method except the Full Attention
    baseline shown beside every answer."""
    from kvrag.methods import METHODS

    return [DEFAULT_CHOICE] + sorted(name for name in METHODS if name != BASELINE)


def session_salt() -> str:
    """This browser session's own scope of the exact prefix cache: a first question never continues another
    session's turn, so no speed-up is credited to a cache this session did not fill."""
    import secrets

    return st.session_state.setdefault("kvrag_cache_salt", secrets.token_hex(16))


def method_summary(name: str) -> str:
    """First line of the method's docstring, for a caption under the selectbox."""
    from kvrag.methods import METHODS

    if name == DEFAULT_CHOICE:
        known = load_engine().peek_default()
        return f"the default here: {known.note()}" if known is not None else "the default: not calibrated yet"
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
def open_index(home: str) -> Any:
    """The index `kvrag ingest` and the quickstart fill (one client per $KVRAG_HOME per process):
    embedded under `home`/chroma, or the shared one `kvrag demo --index` (or $KVRAG_INDEX) names."""
    import os

    from kvrag.ingest.retrieval import ChunkIndex

    if os.environ.get("KVRAG_INDEX"):
        return ChunkIndex(url=os.environ["KVRAG_INDEX"])
    return ChunkIndex(Path(home) / "chroma")


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
CONVERSATION = "conversation"  # session state: this browser session's turns, as plain dicts


@dataclass
class Reply:
    """One assistant turn as the page shows it, with Full Attention's reference beside it (plain data:
    session state keeps it, and a rerun re-executes this script, so its classes are new objects)."""

    text: str  # the method's answer: what the conversation carries on with
    method: str
    ratio: float
    stats: dict[str, Any]
    full_text: str  # Full Attention over the same conversation and chunks, prefix cache off
    full_stats: dict[str, Any]
    kl: float  # first-token KL divergence of the method from Full Attention
    chunks: list[ChunkView]
    chunk_ids: list[str]  # in prompt order: a follow-up reads those it retrieves again in this order (keep_order)

    @property
    def speedup(self) -> float:
        return self.full_stats["ttft_s"] / max(self.stats["ttft_s"], 1e-9)

    @property
    def same(self) -> bool:
        return bool(agreement(self.text, self.full_text))

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, data: Any) -> "Reply | None":
        """Rebuild a reply kept by `to_state` (None if the state holds something else)."""
        try:
            return cls(**{**data, "chunks": [ChunkView(**c) for c in data["chunks"]], "kl": float(data["kl"])})
        except (KeyError, TypeError):
            return None


def conversation() -> list[dict[str, Any]]:
    """This session's turns: {"role", "content"} and, on an assistant turn, "reply" (`Reply.to_state`)."""
    return st.session_state.setdefault(CONVERSATION, [])


def messages_of(turns: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The turns as the engine reads them (OpenAI-style messages)."""
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def previous_chunk_ids(turns: list[dict[str, Any]]) -> list[str]:
    for turn in reversed(turns):
        if turn["role"] == "assistant" and isinstance(turn.get("reply"), dict):
            return list(turn["reply"].get("chunk_ids") or [])
    return []


def show_reply(reply: Reply, open_chunks: bool = False) -> None:
    """Under an answer: what read the prompt, its TTFT beside Full Attention's with the quality, the
    prefix-cache hit, its own counts, the reference answer, and the chunks."""
    stats, name = reply.stats, short_name(reply.method, reply.stats)
    st.caption(f"Method: {method_line(reply.method, reply.ratio, stats)}")
    ttft, full, speed, close, kl = st.columns(5)
    ttft.metric("Time to first token", f"{stats['ttft_s'] * 1000:.0f} ms", help=f"this answer's ({name})")
    full.metric("Full Attention TTFT", f"{reply.full_stats['ttft_s'] * 1000:.0f} ms",
                help="the same conversation and chunks, re-read whole (prefix cache off)")
    # a fast wrong answer is worth nothing: the speed-up is never shown apart from the quality
    if stats.get("full_reason") and not stats.get("prefix_hit_tokens"):  # the same work as Full: no ratio to show
        speed.metric("Speed-up in TTFT", "same as Full", help="read whole: the context was computed as Full Attention computes it")
    else:
        speed.metric("Speed-up in TTFT", f"{reply.speedup:.1f}×", help=f"Full Attention's TTFT ÷ this answer's ({name}); "
                     f"from {speed_source(stats)}")
    close.metric("Same answer as Full", "yes" if reply.same else "no", help="the two answers' texts, normalised, are equal")
    kl.metric("First-token KL", f"{max(reply.kl, 0.0):.3f}",
              help="KL divergence of this answer's first-token distribution from Full Attention's: 0 means identical")
    st.caption(f"Prefix cache: {prefix_line(stats)}. It is this browser session's own; the speed-up came from "
               f"{speed_source(stats)}. {counts_line(stats)}")
    with st.expander("Full Attention's answer (the reference: whole conversation re-read, prefix cache off)"):
        show_answer(reply.full_text)
    st.caption(chunks_caption(reply.method, stats, reply.chunks))
    with st.expander(f"Retrieved chunks ({len(reply.chunks)})", expanded=open_chunks):
        for view in reply.chunks:
            st.markdown(f"**{view.label}**")  # plain_label'd: no markup of the user's
            st.markdown(view.html, unsafe_allow_html=True)  # built from html.escape'd text only


def answer_turn(rag: Any, index: Any, turns: list[dict[str, Any]], settings: "Settings") -> Reply | None:
    """Retrieve with the conversation, stream the method's answer to the whole conversation (prefix
    cache on), then run Full Attention over the same conversation and chunks for comparison."""
    messages = messages_of(turns)
    chunks = index.query(Conversation.of(messages).retrieval_query(), k=settings.top_k)
    if not chunks:
        st.error("Nothing is indexed yet, so there is nothing to answer from.")
        return None
    chunks = keep_order(chunks, previous_chunk_ids(turns))
    with st.chat_message("assistant"):
        pre = rag.prefill(messages=messages, chunks=chunks, method=settings.method, recompute_ratio=settings.ratio,
                          prefix_cache=True, cache_salt=session_salt())
        stream = rag.decode(pre, max_new_tokens=settings.max_new)
        text = stream_answer(stream)  # plain text: the model's Markdown, links and images are not rendered
        with st.spinner("Full Attention re-reads the whole conversation, for comparison ..."):
            full_pre = rag.prefill(messages=messages, chunks=chunks, method=BASELINE, prefix_cache=False)
            full = rag.decode(full_pre, max_new_tokens=settings.max_new)
            full_text = "".join(full)
        stats: AnswerStats = stream.stats
        chosen = rag.default_setting if settings.method is None else None  # the default: named as what it was
        reply = Reply(
            text=text, method=chosen.name if chosen else settings.method, ratio=chosen.ratio if chosen else settings.ratio,
            stats=stats.as_dict(),
            full_text=full_text, full_stats=full.stats.as_dict(), kl=first_token_kl(full_pre.logits, pre.logits),
            chunks=chunk_views(rag, pre, whole=bool(stats.full_reason)), chunk_ids=[c.id for c in pre.chunks],
        )
        show_reply(reply, open_chunks=True)
    return reply


def show_conversation(turns: list[dict[str, Any]]) -> None:
    """Redraw the conversation so far (a rerun shows it without recomputing anything)."""
    last = max((i for i, t in enumerate(turns) if t["role"] == "assistant"), default=-1)
    for i, turn in enumerate(turns):
        with st.chat_message(turn["role"]):
            show_answer(turn["content"])  # questions too: plain text
            reply = Reply.from_state(turn.get("reply")) if turn["role"] == "assistant" else None
            if reply is not None:
                show_reply(reply, open_chunks=i == last)


def ask(rag: Any, index: Any, question: str, settings: "Settings") -> None:
    """One turn: the question joins the conversation, the answer (with its report) follows it; on an
    error the question is taken back, so the conversation stays question, answer, question, ..."""
    turns = conversation()
    turns.append({"role": "user", "content": question})
    with st.chat_message("user"):
        show_answer(question)
    try:
        reply = answer_turn(rag, index, turns, settings)
    except (KVRagError, ValueError, TypeError) as exc:
        longer = " (a long conversation may not fit the model: start a new one)" if len(turns) > 1 else ""
        st.error(f"Could not answer: {exc}{longer}")
        reply = None
    if reply is None:
        turns.pop()
        return
    turns.append({"role": "assistant", "content": reply.text, "reply": reply.to_state()})


# -- page -----------------------------------------------------------------------------------------
@dataclass
class Settings:
    method: str | None  # None: the default setting (calibrated per model)
    ratio: float
    top_k: int
    max_new: int
    store_url: str


def sidebar_settings(folder: Path) -> Settings:
    names = method_names()
    sb = st.sidebar
    sb.header("Settings")
    method = sb.selectbox("Method", names, index=0, key="method")  # starts at the default, whatever it is here
    sb.caption(method_summary(method))
    ratio = sb.slider("Recompute ratio", 0.0, 1.0, DEFAULT_RATIO, 0.01, key="ratio",
                      disabled=method in RATIO_FREE or method == DEFAULT_CHOICE,
                      help="share of the retrieved chunks' tokens the method recomputes (the default: as calibrated)")
    top_k = sb.slider("Chunks to retrieve (top-k)", 1, 10, DEFAULT_K, key="top_k")
    max_new = sb.slider("Max new tokens", 8, 256, DEFAULT_MAX_NEW_TOKENS, 8, key="max_new")
    store_url = sb.text_input(
        "KV store URL", value=default_store_url(folder), key="store_url",
        help="disk:///path, memory://, redis://host:6379/0 or tiered://?lower=...",
    ).strip()
    if method == DEFAULT_CHOICE:
        return Settings(None, DEFAULT_RATIO, top_k, max_new, store_url or default_store_url(folder))
    return Settings(method, ratio, top_k, max_new, store_url or default_store_url(folder))


def show_store(rag: Any) -> None:
    """The store in use and its lookup counters: cumulative, every session's and the ingestion's since the
    server started (each answer shows its own lookups beside it)."""
    sb = st.sidebar
    sb.header("KV store")
    sb.code(redact_url(rag.store.url), language=None)
    try:
        stats = rag.store.stats()
    except Exception as exc:  # a store fault must not break the page
        sb.warning(f"store statistics unavailable: {exc}")
        return
    sb.caption(f"Cumulative store lookups since the server started (all sessions, ingestion included): "
               f"{stats.hits} hits, {stats.misses} misses. Each answer lists its own beside it.")


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


def calibrate_visibly(rag: Any) -> None:
    """Where this model has no kept calibration, run it now with its progress on the page (once per model and
    device: every later page and process reads the kept result), so the picker's "default" says what it is."""
    if rag.peek_default() is not None:
        return
    with st.status("Calibrating the default setting for this model (once; minutes on a CPU) ...", expanded=True) as box:
        setting, _ = rag.calibrate_default(progress=lambda line: box.write(line))
        box.update(label=f"The default here: {setting.label()}", state="complete", expanded=False)


def main() -> None:
    st.set_page_config(page_title="kvrag demo", layout="wide")
    st.title("kvrag: RAG answers from reused KV caches")
    st.caption(
        "Ask a question, then follow-ups. Each retrieved chunk's KV cache was computed once and stored; the method "
        "stitches the cached chunks together and recomputes only a few tokens, and the next turn reuses this turn's KV "
        "(prefix cache). Beside each answer, Full Attention re-reads the whole conversation, for comparison."
    )
    warn_if_exposed()
    folder = data_dir()
    settings = sidebar_settings(folder)
    rag = open_or_stop(settings)
    index = open_index(str(kvrag_home()))
    calibrate_visibly(rag)
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

    if st.button("New conversation", key="new_conversation", help="forget this conversation and start again"):
        conversation().clear()
    turns = conversation()
    sample = sample_questions()[0]["question"]
    slot = st.empty()  # the suggestion's place, kept after the first turn so the turns keep theirs across reruns
    suggested = not turns and slot.button(f"Try: {sample}", key="suggestion")
    show_conversation(turns)
    question = st.chat_input(f"Ask a question or a follow-up, e.g. {sample}", key="question")
    question = (question or (sample if suggested else "")).strip()
    if question:
        ask(rag, index, question, settings)
    show_store(rag)


if __name__ == "__main__":
    main()
