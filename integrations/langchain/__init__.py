"""LangChain integration: `ChatKVRag` (a chat model over a KVRag engine) and `create_kvrag_chain`
(retriever -> prefetch -> answer from stored KV). Needs `pip install kvrag[langchain]`."""

from .chain import KVRagChain, create_kvrag_chain
from .chat_model import ChatKVRag, documents_to_chunks
from .retriever import ChunkIndexRetriever

__all__ = ["ChatKVRag", "ChunkIndexRetriever", "KVRagChain", "create_kvrag_chain", "documents_to_chunks"]
