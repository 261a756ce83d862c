"""`ChatKVRag`: a LangChain chat model whose answers reuse kvrag's per-chunk KV caches.

The messages (system text, history, the last human message) reach the model through its chat
template. Passing `documents=[Document, ...]` to a call answers them from those documents through the
engine's chunk path (stored KV stitched, not re-read); without documents `KVRag.complete_chat` still
reuses any known chunk a prompt template pasted into the messages.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Iterator, Literal, Sequence

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import AliasChoices, Field, PrivateAttr

from kvrag.chat import Conversation, Turn, last_user_text, prompt_of
from kvrag.engine import AnswerStream, KVRag
from kvrag.kv.layout_options import LayoutOptions, face_layout
from kvrag.model.loading import BUNDLED_NAME
from kvrag.defaults import DEFAULT_METHOD, TUNED_METHOD
from kvrag.options import AnswerOptions
from kvrag.client import stream_via_server
from kvrag.types import AnswerStats, Chunk

_ROLES = {"human": "user", "ai": "assistant"}  # LangChain message types -> OpenAI roles (the rest are the same)
# langchain-core >= 1.0 marks the closing chunk of a stream; older cores lack the field.
_LAST: dict[str, Any] = {"chunk_position": "last"} if "chunk_position" in AIMessageChunk.model_fields else {}

def documents_to_chunks(documents: Sequence[Document | Chunk]) -> list[Chunk]:
    """LangChain documents as engine chunks; a document without an id is keyed by a hash of its text,
    so the same text maps to the same stored KV on every call."""
    out: list[Chunk] = []
    for doc in documents:
        if isinstance(doc, Chunk):
            out.append(doc)
            continue
        cid = getattr(doc, "id", None) or hashlib.sha256(doc.page_content.encode("utf-8")).hexdigest()[:16]
        meta = dict(doc.metadata or {})
        out.append(Chunk(id=str(cid), text=doc.page_content, title=str(meta.get("title", "") or ""), metadata=meta))
    return out


def turns_of(messages: Sequence[BaseMessage]) -> list[Turn]:
    """LangChain messages as `kvrag.chat` turns (role names in OpenAI's vocabulary)."""
    return [(m.role.lower() if isinstance(m, ChatMessage) else _ROLES.get(m.type, m.type), m.content) for m in messages]


def messages_to_prompt(messages: Sequence[BaseMessage]) -> str:
    """One plain-text prompt for `KVRag.complete` (see `kvrag.chat.prompt_of`)."""
    return prompt_of(turns_of(messages))


def last_human_text(messages: Sequence[BaseMessage]) -> str:
    return last_user_text(turns_of(messages))


def usage_of(stats: AnswerStats) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=stats.prompt_tokens,
        output_tokens=stats.generated_tokens,
        total_tokens=stats.prompt_tokens + stats.generated_tokens,
    )


class ChatKVRag(BaseChatModel):
    """Chat model over a local `KVRag` engine (created lazily from `model_name`/`store`, or passed as `rag=`).

    Per-call keyword arguments: `documents` (list of `Document`), and any of `method`,
    `recompute_ratio`, `max_new_tokens` (or `max_tokens`), `temperature`, `top_p`, `seed`,
    `kv_kind`, `evict`, plus the method's own parameters (e.g. `layer=1`).
    With `documents`, only the last human message is read: the engine's own system prompt is part
    of the cached prefix that every chunk's KV was computed after, so other turns cannot go in front.
    """

    method: str | None = Field(default=None, description=f"Method: reuse, full, cacheblend, epic, a3, fusionrag, samkv, kvlink (default None: the engine's, {TUNED_METHOD} over the tuned bundled model, else the model's calibrated setting, {DEFAULT_METHOD} with calibration off).")
    recompute_ratio: float | Literal["auto"] = Field(default=0.15, description="Share of chunk tokens recomputed by selective methods, or 'auto' (per request).")
    max_new_tokens: int = Field(
        default=64,
        validation_alias=AliasChoices("max_new_tokens", "max_tokens"),
        description="Most tokens to generate (also accepted as LangChain's standard `max_tokens`).",
    )
    temperature: float = Field(default=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, description="Nucleus sampling mass (with temperature > 0).")
    seed: int | None = Field(default=None, description="Sampling seed, for reproducible sampled answers.")
    stop: list[str] | None = Field(default=None, description="Stop strings, merged with a call's `stop`.")
    method_params: dict[str, Any] = Field(default_factory=dict, description="Extra parameters of the method, e.g. {'layer': 1}.")
    model_name: str | None = Field(default=None, description="HF id, local folder or .gguf path; None is the bundled SmolLM2.")
    store: str | None = Field(default=None, description="KV store URL (memory://, disk:///path, redis://, tiered://); None is the default disk store.")
    streaming: bool = Field(default=False, description="Route `invoke` through streaming (LangChain convention).")
    server: str | None = Field(default=None, description="URL of a running `kvrag serve` (e.g. http://127.0.0.1:8600); calls go over HTTP and no model is loaded here.")
    layout: dict[str, Any] | str | None = Field(default=None, description="The prompt layout, one object (kvrag.LayoutOptions fields: place, instruction, chunk_template, question_template, ...), a preset name or JSON; None is the default. Checked when the chat model is made.")

    _rag: KVRag | None = PrivateAttr(default=None)
    _rag_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _last_stats: AnswerStats | None = PrivateAttr(default=None)

    def __init__(self, *, rag: KVRag | None = None, **kwargs: Any) -> None:
        if isinstance(kwargs.get("layout"), LayoutOptions):
            kwargs["layout"] = kwargs["layout"].to_dict()
        super().__init__(**kwargs)
        face_layout(self.layout, rag=rag, server=self.server)
        self._rag = rag

    @property
    def rag(self) -> KVRag:
        """The engine; loading the model is deferred to first use so constructing the chat model is cheap."""
        if self._rag is None:
            with self._rag_lock:
                if self._rag is None:
                    self._rag = KVRag.from_pretrained(model=self.model_name, store=self.store, layout=face_layout(self.layout))
        return self._rag

    @property
    def model_label(self) -> str:
        """The model's name for traces and `response_metadata` (never loads the model)."""
        if self.model_name:
            return self.model_name
        if self.server:
            return f"kvrag server {self.server}"
        return str(self._rag.lm.source) if self._rag is not None else BUNDLED_NAME

    @property
    def _llm_type(self) -> str:
        return "kvrag"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_label,
            "method": self.method,
            "recompute_ratio": self.recompute_ratio,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "store": self.store,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="kvrag",
            ls_model_name=kwargs.get("model") if isinstance(kwargs.get("model"), str) else self.model_label,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_new_tokens)),
        )
        if stop or self.stop:
            params["ls_stop"] = self._stops(stop)
        return params

    # -- the engine call --------------------------------------------------------------------------
    def _stops(self, stop: list[str] | None) -> list[str]:
        return list(dict.fromkeys([*(self.stop or ()), *(stop or ())]))

    def _start(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> AnswerStream:
        """Prefill (under the engine lock) and return the engine's stream, ready to decode."""
        kwargs = dict(kwargs)
        documents = kwargs.pop("documents", None)
        model = kwargs.pop("model", None)
        if model is not None and model != self.model_label:
            raise ValueError(f"ChatKVRag serves one model ({self.model_label}); per-call model={model!r} is not supported")
        if "max_tokens" in kwargs:
            kwargs["max_new_tokens"] = kwargs.pop("max_tokens")
        opts = AnswerOptions.from_kwargs(
            method=self.method,
            recompute_ratio=self.recompute_ratio,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            **self.method_params,
        )
        opts = AnswerOptions.from_kwargs(opts, **kwargs, stop=self._stops(stop) or None)
        conv = Conversation.of(turns_of(messages))
        if self.server:
            if documents is not None:
                return stream_via_server(self.server, conv.messages(), chunks=documents_to_chunks(documents), options=opts)
            return stream_via_server(self.server, conv.messages(), options=opts)
        rag = self.rag
        if documents is not None:
            return rag.stream_chat(conv, chunks=documents_to_chunks(documents), options=opts)
        return rag.complete_chat(conv, options=opts)

    def _pieces(self, stream: AnswerStream) -> Iterator[str]:
        """The stream's text pieces, the leading whitespace dropped to match `invoke`'s stripped answer."""
        started = False
        for piece in stream:
            if not started:  # match `invoke`, whose answer is stripped
                piece = piece.lstrip()
                started = bool(piece)
            if piece:
                yield piece

    @property
    def last_stats(self) -> AnswerStats | None:
        """Stats of the last answer (path, ttft, cache hits, recomputed tokens...), the object
        `KVRagLLM.last_stats` gives too: `.summary()`, `.as_dict()`, and `stats["ttft_s"]`. Each
        message also carries them as a dict, `response_metadata["stats"]` (what concurrent calls should read)."""
        return self._last_stats

    def _metadata(self, stats: AnswerStats) -> dict[str, Any]:
        self._last_stats = stats
        return {"model_name": self.model_label, "stats": stats.as_dict()}

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        stream = self._start(messages, stop, kwargs)
        text = "".join(self._pieces(stream)).strip()
        meta = self._metadata(stream.stats)
        message = AIMessage(content=text, response_metadata=meta, usage_metadata=usage_of(stream.stats))
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=meta)], llm_output={"model_name": self.model_label})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        stream = self._start(messages, stop, kwargs)
        for piece in self._pieces(stream):
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        meta = self._metadata(stream.stats)
        last = AIMessageChunk(content="", response_metadata=meta, usage_metadata=usage_of(stream.stats), **_LAST)
        yield ChatGenerationChunk(message=last, generation_info=meta)
