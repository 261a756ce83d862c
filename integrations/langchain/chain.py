"""`create_kvrag_chain`: retrieve -> prefetch KV -> answer from the retrieved documents' stored KV.

A stock LCEL RAG chain pastes documents into a prompt, so the model re-reads them every time; this
chain hands the documents to the engine instead, so each one's precomputed KV is reused, and it
starts loading that KV (`prefetch`) as soon as retrieval returns.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterator, Union

from langchain_core.callbacks import (
    AsyncCallbackManagerForChainRun,
    CallbackManagerForChainRun,
)
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import patch_config

from kvrag.chat import text_of
from kvrag.types import AnswerStats

from .chat_model import ChatKVRag, documents_to_chunks

ChainInput = Union[str, dict[str, Any]]


def question_of(value: ChainInput) -> str:
    """The question: the input itself, or its "question" / "input" key (LangChain's two conventions)."""
    if isinstance(value, dict):
        for key in ("question", "input"):
            if isinstance(value.get(key), str):
                return value[key]
        raise ValueError(f"expected a question string or a dict with 'question' or 'input', got keys {sorted(value)}")
    if isinstance(value, str):
        return value
    raise TypeError(f"expected a question string or a dict, got {type(value).__name__}")


class KVRagChain(Runnable[ChainInput, Any]):
    """Retriever + `ChatKVRag`: `invoke` returns the answer (or answer, documents and stats with
    `return_sources=True`); `stream` yields the answer's text pieces as they are decoded."""

    def __init__(
        self,
        retriever: Runnable[str, list[Document]],
        llm: ChatKVRag,
        *,
        method: str | None = None,
        recompute_ratio: float | None = None,
        return_sources: bool = False,
    ) -> None:
        if not isinstance(llm, ChatKVRag):
            raise TypeError(f"llm must be a ChatKVRag (the chain reads its engine), got {type(llm).__name__}")
        self.retriever = retriever
        self.llm = llm
        self.method = method
        self.recompute_ratio = recompute_ratio
        self.return_sources = return_sources

    def _llm_kwargs(self, documents: list[Document]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"documents": documents}
        if self.method is not None:
            kwargs["method"] = self.method
        if self.recompute_ratio is not None:
            kwargs["recompute_ratio"] = self.recompute_ratio
        return kwargs

    def _prefetch(self, documents: list[Document]) -> None:
        """Start loading the documents' KV now (a tiered store loads in the background meanwhile)."""
        if documents:
            self.llm.rag.prefetch(chunks=documents_to_chunks(documents))

    def _output(self, message: BaseMessage, documents: list[Document]) -> Any:
        answer = text_of(message.content)
        if not self.return_sources:
            return answer
        # the stats object both integrations give (KVRagLLM.last_stats, ChatKVRag.last_stats): .summary(), and a dict view
        return {"answer": answer, "documents": documents, "stats": AnswerStats.from_dict(message.response_metadata.get("stats", {}))}

    # -- sync -------------------------------------------------------------------------------------
    def invoke(self, input: ChainInput, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(self._invoke, input, config)

    def _invoke(self, input: ChainInput, run_manager: CallbackManagerForChainRun, config: RunnableConfig) -> Any:
        question = question_of(input)
        child = patch_config(config, callbacks=run_manager.get_child())
        documents = self.retriever.invoke(question, child)
        self._prefetch(documents)
        message = self.llm.invoke(question, child, **self._llm_kwargs(documents))
        return self._output(message, documents)

    def stream(self, input: ChainInput, config: RunnableConfig | None = None, **kwargs: Any | None) -> Iterator[str]:
        yield from self._transform_stream_with_config(iter([input]), self._pieces, config)

    def _pieces(self, inputs: Iterator[ChainInput], config: RunnableConfig) -> Iterator[str]:
        question = question_of(next(inputs))
        documents = self.retriever.invoke(question, config)
        self._prefetch(documents)
        for chunk in self.llm.stream(question, config, **self._llm_kwargs(documents)):
            if piece := text_of(chunk.content):
                yield piece

    # -- async ------------------------------------------------------------------------------------
    async def ainvoke(self, input: ChainInput, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return await self._acall_with_config(self._ainvoke, input, config)

    async def _ainvoke(self, input: ChainInput, run_manager: AsyncCallbackManagerForChainRun, config: RunnableConfig) -> Any:
        question = question_of(input)
        child = patch_config(config, callbacks=run_manager.get_child())
        documents = await self.retriever.ainvoke(question, child)
        await asyncio.to_thread(self._prefetch, documents)
        message = await self.llm.ainvoke(question, child, **self._llm_kwargs(documents))
        return self._output(message, documents)

    async def astream(self, input: ChainInput, config: RunnableConfig | None = None, **kwargs: Any | None) -> AsyncIterator[str]:
        async def one() -> AsyncIterator[ChainInput]:
            yield input

        async for piece in self._atransform_stream_with_config(one(), self._apieces, config):
            yield piece

    async def _apieces(self, inputs: AsyncIterator[ChainInput], config: RunnableConfig) -> AsyncIterator[str]:
        question = question_of(await anext(inputs))
        documents = await self.retriever.ainvoke(question, config)
        await asyncio.to_thread(self._prefetch, documents)
        async for chunk in self.llm.astream(question, config, **self._llm_kwargs(documents)):
            if piece := text_of(chunk.content):
                yield piece


def create_kvrag_chain(
    retriever: Runnable[str, list[Document]],
    llm: ChatKVRag,
    *,
    method: str | None = None,
    recompute_ratio: float | None = None,
    return_sources: bool = False,
) -> KVRagChain:
    """A RAG chain whose answers reuse the retrieved documents' KV caches.

    Input: a question string, or a dict with "question" or "input". Output: the answer string, or
    `{"answer", "documents", "stats"}` with `return_sources=True` (`stream` always yields text).
    `method` / `recompute_ratio` override the chat model's own settings for this chain.
    """
    return KVRagChain(retriever, llm, method=method, recompute_ratio=recompute_ratio, return_sources=return_sources)
