"""The exception types a user can catch; each says what went wrong and what to do."""


class KVRagError(Exception):
    """Base of every kvrag error."""


class EmptyRetrievalError(KVRagError, ValueError):
    """An answer was asked for with no chunks to read."""


class ChunkNotFoundError(KVRagError, KeyError):
    """A chunk id was neither precomputed nor given with its text; `ids`: the ids that were not found
    (so a face can say what to do in its own terms)."""

    def __init__(self, message: str = "chunk not found", ids: "list[str] | None" = None) -> None:
        super().__init__(message)
        self.ids = list(ids or [])

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "chunk not found"


class StoreUnavailableError(KVRagError, RuntimeError):
    """The KV store's id index (shared through Redis) cannot be read now; nothing was changed: retry once
    the store is back."""


class ContextTooLongError(KVRagError, ValueError):
    """The prompt would not fit in the model's context window."""


class UnsupportedModelError(KVRagError, ValueError):
    """The model lacks what cache reuse needs (rotary position embeddings, a decoder-only LM, ...)."""


class ModelLoadError(KVRagError, RuntimeError):
    """The model could not be found or loaded."""


class AdapterMismatchError(KVRagError, ValueError):
    """A KVLink link adapter was trained for another base model or prompt layout (or is not an adapter)."""
