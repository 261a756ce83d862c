"""`KVRagIngestion`: an ingestion step that precomputes every node's chunk KV."""

from __future__ import annotations

from typing import Any, Sequence

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, TransformComponent

from kvrag.engine import KVRag
from kvrag.integrations.llama_index.llm import KVRagLLM, node_to_chunk


class KVRagIngestion(TransformComponent):
    """Add to `IngestionPipeline(transformations=[..., KVRagIngestion(llm)])` or `VectorStoreIndex(...,
    transformations=[...])`: nodes pass through unchanged, their KV is computed and stored."""

    batch_size: int = Field(default=8, description="chunks per forward pass")
    progress: bool = Field(default=True, description="show a progress bar")
    _rag: KVRag = PrivateAttr()

    def __init__(self, llm: KVRagLLM | KVRag, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rag = llm.rag if isinstance(llm, KVRagLLM) else llm

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        chunks = [node_to_chunk(n) for n in nodes]
        if chunks:
            self._rag.precompute(chunks, batch_size=self.batch_size, progress=self.progress)
        return nodes
