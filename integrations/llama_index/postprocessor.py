"""`KVCacheNodePostprocessor`: hands the retrieved nodes to the LLM and starts loading their KV."""

from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from kvrag.integrations.llama_index.llm import KVRagLLM, hand_over, node_to_chunk


class KVCacheNodePostprocessor(BaseNodePostprocessor):
    """Put last in `node_postprocessors`: the nodes pass through unchanged, their KV starts loading
    (a tiered store prefetches in the background) and the LLM answers the query from that KV."""

    _llm: KVRagLLM = PrivateAttr()

    def __init__(self, llm: KVRagLLM, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._llm = llm

    @classmethod
    def class_name(cls) -> str:
        return "KVCacheNodePostprocessor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        chunks = [node_to_chunk(n.node) for n in nodes]
        if chunks:
            if self._llm.rag is not None:  # with `server=`, the server registers and loads them
                self._llm.rag.register(chunks)
                self._llm.rag.prefetch(chunks=chunks)
            if query_bundle is not None:
                hand_over(query_bundle.query_str, chunks)
        return nodes
