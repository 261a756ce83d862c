"""LlamaIndex integration: a drop-in LLM, a node postprocessor, an ingestion step and an embedding.

    from kvrag.integrations.llama_index import KVRagLLM, KVCacheNodePostprocessor, KVRagIngestion
"""

from kvrag.integrations.llama_index.embedding import MiniLMEmbedding
from kvrag.integrations.llama_index.ingestion import KVRagIngestion
from kvrag.integrations.llama_index.llm import KVRagLLM, node_to_chunk
from kvrag.integrations.llama_index.postprocessor import KVCacheNodePostprocessor

__all__ = ["KVCacheNodePostprocessor", "KVRagIngestion", "KVRagLLM", "MiniLMEmbedding", "node_to_chunk"]
