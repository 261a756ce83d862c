"""kvrag: fast RAG answers on a local LLM by reusing per-chunk KV caches."""

from kvrag.engine import AnswerStream, KVRag, Prefill, PrecomputeReport
from kvrag.errors import (
    AdapterMismatchError,
    ChunkNotFoundError,
    ContextTooLongError,
    EmptyRetrievalError,
    KVRagError,
    ModelLoadError,
    UnsupportedModelError,
)
from kvrag.model import LoadedModel, from_model, load_model
from kvrag.types import Answer, AnswerStats, Chunk
from kvrag.version import __version__


__all__ = [
    "AdapterMismatchError",
    "Answer",
    "AnswerStats",
    "AnswerStream",
    "Chunk",
    "ChunkNotFoundError",
    "ContextTooLongError",
    "EmptyRetrievalError",
    "KVRag",
    "KVRagError",
    "LoadedModel",
    "ModelLoadError",
    "Prefill",
    "PrecomputeReport",
    "UnsupportedModelError",
    "from_model",
    "load_model",
]
