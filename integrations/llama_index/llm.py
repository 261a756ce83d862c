"""`KVRagLLM`: a LlamaIndex LLM that answers from cached chunk KV.

It is a chat model (`chat`/`stream_chat` take the messages: chat engines' history and system text
reach the model through its chat template). Two paths, named in `last_stats.path`:
- "postprocessor": `KVCacheNodePostprocessor` handed over this query's nodes, so the LLM answers the
  query (or the conversation) from the nodes' cached KV and ignores the text the response
  synthesizer pasted together (the context message it wrapped them in is left out);
- "prompt-match": no hand-over; chunks the engine knows are found verbatim in the prompt or messages
  and reused, the rest is read normally ("plain" when none is found).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms import CustomLLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.schema import BaseNode, MetadataMode

from kvrag.chat import Conversation
from kvrag.engine import AnswerStream, KVRag
from kvrag.ingest.prompt_match import match_conversation
from kvrag.kv.layout_options import LayoutOptions, face_layout
from kvrag.defaults import DEFAULT_METHOD, TUNED_METHOD
from kvrag.options import AnswerOptions
from kvrag.client import stream_via_server
from kvrag.types import AnswerStats, Chunk


@dataclass
class PendingContext:
    """What a postprocessor hands to the next LLM call in the same context (thread / task)."""

    query: str
    chunks: list[Chunk]


_PENDING: contextvars.ContextVar[PendingContext | None] = contextvars.ContextVar("kvrag_pending", default=None)


def node_to_chunk(node: BaseNode) -> Chunk:
    """A node as a kvrag chunk: its id, its text without metadata, its title if it has one."""
    title = str(node.metadata.get("title") or node.metadata.get("file_name") or "")
    return Chunk(id=node.node_id, text=node.get_content(metadata_mode=MetadataMode.NONE), title=title)


def hand_over(query: str, chunks: Sequence[Chunk]) -> None:
    _PENDING.set(PendingContext(query, list(chunks)))


class KVRagLLM(CustomLLM):
    """Drop-in LlamaIndex LLM (e.g. `Settings.llm = KVRagLLM()`) backed by a kvrag engine."""

    model_name: str | None = Field(default=None, description="HF model id, folder or .gguf; None = bundled SmolLM2-135M-Instruct")
    store: str | None = Field(default=None, description="KV store URL; None = disk under $KVRAG_HOME")
    method: str | None = Field(default=None, description=f"kvrag method: full, reuse, cacheblend, epic, a3, fusionrag, samkv, kvlink (default None: the engine's, {TUNED_METHOD} over the tuned bundled model, else the model's calibrated setting, {DEFAULT_METHOD} with calibration off)")
    recompute_ratio: float | Literal["auto"] = Field(default=0.15, description="share of chunk tokens recomputed by selective methods, or 'auto' (per request)")
    max_new_tokens: int = Field(default=128, description="tokens to generate at most")
    temperature: float = Field(default=0.0, description="0 = greedy")
    top_p: float = Field(default=1.0, description="nucleus sampling threshold")
    server: str | None = Field(default=None, description="URL of a running `kvrag serve`; calls go over HTTP and no model is loaded here")
    context_window: int = Field(default=8192, description="the served model's context (used only with `server`)")
    layout: dict[str, Any] | str | None = Field(default=None, description="the prompt layout, one object (kvrag.LayoutOptions fields: place, instruction, chunk_template, question_template, ...), a preset name or JSON; None = the default; checked when the LLM is made")

    _rag: KVRag = PrivateAttr()
    _last_stats: AnswerStats | None = PrivateAttr(default=None)

    def __init__(self, rag: KVRag | None = None, **kwargs: Any) -> None:
        if isinstance(kwargs.get("layout"), LayoutOptions):
            kwargs["layout"] = kwargs["layout"].to_dict()
        super().__init__(**kwargs)
        opts = face_layout(self.layout, rag=rag, server=self.server)
        self._rag = rag if rag is not None or self.server else KVRag.from_pretrained(self.model_name, store=self.store, layout=opts)

    @property
    def rag(self) -> KVRag:
        return self._rag

    @property
    def last_stats(self) -> AnswerStats | None:
        """Stats of the last answer (path, ttft, cache hits, recomputed tokens...)."""
        return self._last_stats

    @classmethod
    def class_name(cls) -> str:
        return "KVRagLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._rag.lm.max_context if self._rag is not None else self.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            model_name=self.model_name or (self._rag.lm.source if self._rag is not None else f"kvrag server {self.server}"),
        )

    def options(self, **overrides: Any) -> AnswerOptions:
        """This LLM's answer options (its fields), with a call's keyword arguments on top."""
        base = AnswerOptions.from_kwargs(
            method=self.method,
            recompute_ratio=self.recompute_ratio,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
        )
        return AnswerOptions.from_kwargs(base, **overrides)

    def _call_options(self, kwargs: dict[str, Any]) -> AnswerOptions:
        known = ("method", "recompute_ratio", "max_new_tokens", "temperature", "top_p", "stop", "prefix_cache")
        return self.options(**{k: kwargs.pop(k) for k in known if k in kwargs})

    def _start_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> AnswerStream:
        """A chat engine's messages: from a hand-over's nodes when the postprocessor ran for this call
        (its nodes pasted into the messages, or its query among them), else `complete_chat`."""
        opts = self._call_options(kwargs)
        conv = Conversation.of(messages)
        pending = _PENDING.get()
        if pending is not None:
            found, rest = match_conversation(conv, pending.chunks)
            if found or any(pending.query.strip() in text for _, text in conv.turns):
                _PENDING.set(None)  # one hand-over serves one call
                conv = rest if found else conv
                if self.server:
                    stream = stream_via_server(self.server, conv.messages(), chunks=pending.chunks, options=opts)
                else:
                    stream = self._rag.stream_chat(conv, chunks=pending.chunks, options=opts)
                stream.stats.path = "postprocessor"
                self._last_stats = stream.stats
                return stream
        stream = stream_via_server(self.server, conv.messages(), options=opts) if self.server else self._rag.complete_chat(conv, options=opts)
        self._last_stats = stream.stats
        return stream

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        answer = self._start_chat(messages, kwargs).answer()
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=answer.text),
                            additional_kwargs={"kvrag_stats": answer.stats.as_dict()})

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream = self._start_chat(messages, kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for piece in stream:
                if not text:
                    piece = piece.lstrip()  # as `chat`, whose answer is stripped
                if not piece:
                    continue
                text += piece
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=piece)
            yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text.rstrip()), delta="",
                               additional_kwargs={"kvrag_stats": stream.stats.as_dict()})

        return gen()

    def _start(self, prompt: str, kwargs: dict[str, Any]) -> AnswerStream:
        opts = self._call_options(kwargs)
        pending = _PENDING.get()
        if pending is not None and pending.query.strip() not in prompt:
            pending = None  # a hand-over serves only the call made for its query (the synthesizer's prompt holds it)
        if pending is not None:
            _PENDING.set(None)  # one hand-over serves one call
            if self.server:
                stream = stream_via_server(self.server, pending.query, chunks=pending.chunks, options=opts)
            else:
                stream = self._rag.stream(pending.query, chunks=pending.chunks, options=opts)
            stream.stats.path = "postprocessor"
        elif self.server:
            stream = stream_via_server(self.server, prompt, options=opts)
        else:
            stream = self._rag.complete(prompt, options=opts)
        self._last_stats = stream.stats
        return stream

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        answer = self._start(prompt, kwargs).answer()
        return CompletionResponse(text=answer.text, additional_kwargs={"kvrag_stats": answer.stats.as_dict()})

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stream = self._start(prompt, kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in stream:
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            yield CompletionResponse(text=text, delta="", additional_kwargs={"kvrag_stats": stream.stats.as_dict()})

        return gen()
