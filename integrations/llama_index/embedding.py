"""`MiniLMEmbedding`: LlamaIndex embeddings from the offline all-MiniLM-L6-v2 that kvrag ships with.

LlamaIndex's default embedding calls a hosted API; this one runs locally with no download.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.embeddings import BaseEmbedding


class MiniLMEmbedding(BaseEmbedding):
    model_name: str = "all-MiniLM-L6-v2"

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _embed(self, texts: list[str]) -> list[list[float]]:
        from kvrag.ingest.retrieval import embedding_function

        return [list(map(float, v)) for v in embedding_function()(texts)]

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embed([query])[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embed(texts)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
