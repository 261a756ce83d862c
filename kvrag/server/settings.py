"""`ServerSettings`: everything `kvrag serve` is configured with, as one dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvrag.kv.layout_options import LayoutOptions


LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class ServerSettings:
    """How the server binds, which engine it loads, how much it admits, and the answer defaults.

    Up to `max_concurrency` requests run at once: their prefills take turns at the model, and their
    answers decode together, one forward a step for all of them (kvrag.decode.batch); 8 by
    measurement (docs/bench/server: throughput still rose from 4 to 8 running requests, and one
    client's latency is unchanged). Requests beyond it wait in a bounded queue; beyond `max_queue`
    they get a 503 at once.
    """

    host: str = "127.0.0.1"
    port: int = 8600
    store: str | None = None  # KV store URL; None: disk under $KVRAG_HOME/kv
    model: str | None = None  # HF id, folder or .gguf; None: the bundled SmolLM2-135M-Instruct
    device: str = "auto"
    max_concurrency: int = 8  # requests running at once: their decode steps are batched
    max_queue: int = 16  # requests waiting for a slot; more get 503
    retry_after_s: int = 1  # the Retry-After a 503 suggests
    max_body_bytes: int = 1 << 20  # request body limit (413 above)
    max_chunks: int = 64  # chunks per request (413 above)
    max_request_tokens: int = 32768  # tokens of text per request: chunk texts plus messages (413 above)
    max_tokens_limit: int = 2048  # the largest max_tokens a request may ask for (400 above)
    link_adapter: str | None = "auto"  # KVRag(link_adapter=...): auto/links (shipped link embeddings), tuned, None, or a file
    method: str | None = None  # the method when a request names none; None: the engine's (KVRag.default_method)
    recompute_ratio: float = 0.15
    max_new_tokens: int = 64  # default max_tokens
    accept_any_model: bool = False  # True: a chat request may name any model; else only the served one or "kvrag" (404 model_not_found)
    # a chat request with no kvrag context (what OpenAI clients send) is answered from the top_k chunks of the
    # server's index ($KVRAG_HOME/chroma, `collection`: what `kvrag ingest` and POST /v1/chunks fill); False: plain chat
    decode_weights: str | None = None  # KVRag(decode_weights=...): "model" (None: its own weights) or "int8" (CPU, opt-in)
    retrieval: bool = True
    top_k: int = 5
    collection: str = "kvrag_chunks"
    # the exact prefix cache (kvrag.kv.prefix_cache): MB of finished turns' KV kept so a conversation's next
    # turn reads only its new tokens; 0: off; None: $KVRAG_PREFIX_CACHE_MB, else 1024
    prefix_cache_mb: int | None = None
    # user turns a follow-up retrieves with (its own and the ones before it: kvrag.chat.Conversation.retrieval_query)
    retrieval_turns: int = 2
    # the retrieval index: None, the embedded one under $KVRAG_HOME/chroma (`collection`); or a shared
    # `chroma://host:port/collection` (a `chroma run` every replica reads and writes: kvrag.ingest.index_url)
    index: str | None = None
    # append "Sources: [1] <title> (<file>)" to answers the server retrieved for (kvrag.server.cite), for clients
    # that show only the text; a request's `"kvrag": {"cite": ...}` overrides it. Off: answers are what the model said
    cite_sources: bool = False
    # the prompt layout (kvrag.kv.layout_options): a preset name, JSON text, a JSON file, a dict or LayoutOptions;
    # None: the default. Checked when the settings are made, so a bad layout stops the start before the model loads
    layout: Any = None
    # API keys (kvrag.server.auth): none, no authentication; else every route but /health needs
    # `Authorization: Bearer <key>`. api_keys may read and write (POST/DELETE /v1/chunks), read_keys only
    # read (chat, models, metrics). Never shown: not in repr, logs or errors.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    read_keys: tuple[str, ...] = field(default=(), repr=False)
    # what callers share of cached state (kvrag.server.tenants): False (default), each API key is its own
    # tenant: its exact prefix cache entries, its inline chunks' KV and its system prefixes are read by its
    # own requests only; True: every key shares them (one trusted tenant, more hits)
    share_prefix_cache: bool = False
    # serve an interface other than loopback without any API key (anyone who reaches it may read and write):
    # refused at start unless this is set (`kvrag serve --allow-no-auth`), as Redis's protected mode refuses
    allow_no_auth: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be 0 or more")
        if self.prefix_cache_mb is not None and self.prefix_cache_mb < 0:
            raise ValueError("prefix_cache_mb must be 0 (off) or more")
        if self.retrieval_turns < 1:
            raise ValueError("retrieval_turns must be at least 1")
        if self.top_k < 1:
            raise ValueError("top_k must be at least 1")
        for key in (*self.api_keys, *self.read_keys):
            if not key or any(not 33 <= ord(ch) <= 126 for ch in key):
                raise ValueError("an API key must be non-empty printable ASCII without spaces: it travels in an HTTP header, "
                                 "which the server reads as latin-1, so a key with any other character could never match")
        if not self.is_loopback and not self.authenticated and not self.allow_no_auth:
            raise ValueError(f"--host {self.host} is reachable from other machines and no API key is given: anyone could run "
                             "the model, read your documents and add or delete chunks. Give keys (--api-key / --read-key, or "
                             "$KVRAG_API_KEYS / $KVRAG_READ_KEYS), bind 127.0.0.1, or pass --allow-no-auth to serve it open anyway")
        LayoutOptions.of(self.layout)  # raises ValueError naming the field
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be within [0, 1], got {self.recompute_ratio}")

    @property
    def layout_options(self) -> LayoutOptions:
        return LayoutOptions.of(self.layout)

    @property
    def authenticated(self) -> bool:
        """Whether requests must carry a key."""
        return bool(self.api_keys or self.read_keys)

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK or self.host.startswith("127.")
