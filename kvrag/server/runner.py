"""`serve(settings)`: load the engine once, then answer over HTTP until stopped."""

from __future__ import annotations

import logging
import sys

from kvrag.server.settings import ServerSettings

log = logging.getLogger("kvrag.server")

NO_AUTH_WARNING = (
    "WARNING: kvrag serve is listening on {host}, not only on this machine, with NO API key: anyone who can reach "
    "{host}:{port} can run the model, read your documents through its answers, and add, replace and delete chunks "
    "for every client. Give keys (--api-key KEY for read+write, --read-key KEY for chat only; or $KVRAG_API_KEYS, "
    "$KVRAG_READ_KEYS), or bind 127.0.0.1."
)


def serve(settings: ServerSettings, rag=None, index=None) -> None:  # noqa: ANN001 (KVRag, ChunkIndex: imported lazily)
    """Load the engine (unless one is given) and the retrieval index (unless given or retrieval is
    off), and run uvicorn in this thread until Ctrl-C."""
    import uvicorn

    from kvrag.server.app import create_app

    for line in startup_notes(settings):
        print(line, file=sys.stderr)
    if index is None and settings.retrieval:  # before the model: a mismatched shared index stops the start at once
        index = open_retrieval_index(settings)
    if rag is None:
        from kvrag.engine import KVRag

        print(f"loading model ({settings.model or 'bundled SmolLM2-135M-Instruct'}) ...", file=sys.stderr)
        from kvrag.kv.prefix_cache import PrefixCache

        mb = settings.prefix_cache_mb
        rag = KVRag.from_pretrained(settings.model, store=settings.store, device=settings.device, link_adapter=settings.link_adapter,
                                    decode_weights=settings.decode_weights, prefix_cache=PrefixCache(None if mb is None else mb * 2**20),
                                    layout=settings.layout_options)
        from kvrag.server.warmup import warm_up

        print(f"warmed up in {warm_up(rag):.1f} s (one tiny answer, kept nowhere)", file=sys.stderr)
        if settings.method is None:  # and the default is known: calibrated once per model, kept for every later start
            if rag.peek_default() is None:  # none kept: calibrate now, each setting's line in the start-up log
                print("calibrating the default setting for this model (once per model and device; minutes on a CPU) ...",
                      file=sys.stderr)
                rag.calibrate_default(progress=lambda line: print("  " + line, file=sys.stderr))
            print(f"default for requests that name no method: {rag.default_setting.note()}", file=sys.stderr)
    app = create_app(rag, settings, index)
    print(f"kvrag serve: http://{settings.host}:{settings.port}/v1 (model {app.state.kvrag.model_name}, store {rag.store.url})", file=sys.stderr)
    run_beside_home(uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                                                  timeout_graceful_shutdown=5)))


def startup_notes(settings: ServerSettings) -> list[str]:
    """What the server says on stderr about who may use it: the warning for an interface others can
    reach with no key, or how many keys of each right it takes (never the keys)."""
    if settings.authenticated:
        return [f"API keys: {len(settings.api_keys)} read+write, {len(settings.read_keys)} read-only; every route but "
                "/health needs `Authorization: Bearer <key>`"]
    if not settings.is_loopback:
        return [NO_AUTH_WARNING.format(host=settings.host, port=settings.port)]
    return []


def open_retrieval_index(settings: ServerSettings):  # noqa: ANN201 (ChunkIndex)
    """The index `kvrag ingest` fills ($KVRAG_HOME/chroma, or the shared `settings.index`), with its
    embedding model loaded now rather than on the first question; says on stderr what plain OpenAI
    requests will be answered from. A shared index with another embedding model stops the start
    (EmbeddingMismatchError); one that does not answer yet does not: retrieval is a 503 until it does."""
    from kvrag.defaults import kvrag_home
    from kvrag.ingest.retrieval import ChunkIndex, IndexUnavailableError, embedding_function

    if settings.index:
        index = ChunkIndex(url=settings.index, collection=settings.collection)
    else:
        index = ChunkIndex(kvrag_home() / "chroma", collection=settings.collection)
    embedding_function()(["warm up"])
    try:
        n = len(index)
    except IndexUnavailableError as exc:
        print(f"retrieval: WARNING: {exc}. Requests that retrieve get 503 (index_unavailable) until it answers; "
              "/health says so", file=sys.stderr)
        return index
    if n:
        print(f"retrieval: requests without kvrag context are answered from the top {settings.top_k} of {n} chunks in "
              f"{index.path} ({index.collection_name}); --no-retrieval for plain chat", file=sys.stderr)
    else:
        print(f"retrieval: the index {index.path} ({index.collection_name}) is empty, so requests without kvrag context are "
              "answered as plain chat until chunks are ingested (`kvrag ingest PATH`, or POST /v1/chunks)", file=sys.stderr)
    return index


def run_beside_home(server) -> None:  # noqa: ANN001 (uvicorn.Server)
    """Serve HTTP from a thread while this thread, which loaded the model, runs every model call
    (kvrag.model.home_thread: one thread for torch's CPU work keeps decoding at full speed). Ctrl-C
    stops the server gracefully."""
    import threading

    from kvrag.model.home_thread import HOME

    stop = threading.Event()

    def http() -> None:
        try:
            server.run()
        finally:
            stop.set()
            HOME.wake()

    thread = threading.Thread(target=http, name="kvrag-http", daemon=True)
    thread.start()
    try:
        HOME.serve(stop)
    except KeyboardInterrupt:
        print("kvrag serve: stopping", file=sys.stderr)
    finally:
        server.should_exit = True
        stop.set()
        # anything still asking for the model now gets an error rather than waiting forever
        thread.join(timeout=10)
