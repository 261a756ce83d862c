"""`ChunkIndexRetriever`: a LangChain retriever over kvrag's embedded chroma index.

The same persistent collection `kvrag ingest` fills (offline all-MiniLM-L6-v2, no download),
so a LangChain app and the CLI share one vector store; documents carry the chunk ids.
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import Field, PrivateAttr

from kvrag.ingest.retrieval import ChunkIndex


class ChunkIndexRetriever(BaseRetriever):
    """Top-k chunks from a `kvrag.ingest.retrieval.ChunkIndex` as LangChain `Document`s (ids kept)."""

    k: int = Field(default=5, description="documents to return")
    _index: ChunkIndex = PrivateAttr()

    def __init__(self, index: ChunkIndex, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._index = index

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [
            Document(id=c.id, page_content=c.text, metadata={**c.metadata, "title": c.title})
            for c in self._index.query(query, k=self.k)
        ]
