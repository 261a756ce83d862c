"""kvrag: fast RAG answers on a local LLM by reusing per-chunk KV caches.

The names below load on first use (module `__getattr__`), so `import kvrag` and the command line's
`--help` start without importing torch; `from kvrag import KVRag` loads the engine then.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from kvrag.version import __version__

_HOMES = {
    "AnswerStream": "kvrag.engine",
    "KVRag": "kvrag.engine",
    "Prefill": "kvrag.engine",
    "PrecomputeReport": "kvrag.engine",
    "AdapterMismatchError": "kvrag.errors",
    "ChunkNotFoundError": "kvrag.errors",
    "ContextTooLongError": "kvrag.errors",
    "EmptyRetrievalError": "kvrag.errors",
    "KVRagError": "kvrag.errors",
    "ModelLoadError": "kvrag.errors",
    "StoreUnavailableError": "kvrag.errors",
    "UnsupportedModelError": "kvrag.errors",
    "LayoutOptions": "kvrag.kv.layout_options",
    "LoadedModel": "kvrag.model.loading",
    "from_model": "kvrag.model.loading",
    "load_model": "kvrag.model.loading",
    "Answer": "kvrag.types",
    "AnswerStats": "kvrag.types",
    "Chunk": "kvrag.types",
}
__all__ = sorted(_HOMES) + ["__version__"]

if TYPE_CHECKING:  # what type checkers and IDEs read; at run time __getattr__ below
    from kvrag.engine import AnswerStream, KVRag, PrecomputeReport, Prefill
    from kvrag.kv.layout_options import LayoutOptions
    from kvrag.errors import (
        AdapterMismatchError,
        ChunkNotFoundError,
        ContextTooLongError,
        EmptyRetrievalError,
        KVRagError,
        ModelLoadError,
        StoreUnavailableError,
        UnsupportedModelError,
    )
    from kvrag.model.loading import LoadedModel, from_model, load_model
    from kvrag.types import Answer, AnswerStats, Chunk


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvrag' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
