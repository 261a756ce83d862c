"""Entry serialisation: safetensors (no pickle) with a versioned header and a checksum.

Decoding untrusted bytes either returns a well-formed entry or raises CorruptEntryError.
"""

from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .base import CorruptEntryError, KVEntry

FORMAT_VERSION = "1"
_MAGIC = "kvrag-entry"


def _checksum(keys: torch.Tensor, values: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in (keys, values):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def encode_entry(entry: KVEntry) -> bytes:
    keys = entry.keys.detach().to("cpu").contiguous()
    values = entry.values.detach().to("cpu").contiguous()
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"entry tensors must be [layers, heads, tokens, dim]; got {tuple(keys.shape)} / {tuple(values.shape)}")
    meta = {str(k): str(v) for k, v in entry.meta.items()}
    meta.update(
        magic=_MAGIC,
        format=FORMAT_VERSION,
        shape=json.dumps(list(keys.shape)),
        vshape=json.dumps(list(values.shape)),
        dtype=str(keys.dtype).removeprefix("torch."),
        checksum=_checksum(keys, values),
    )
    return st_save({"k": keys, "v": values}, metadata=meta)


def decode_entry(data: bytes) -> KVEntry:
    try:
        tensors = st_load(bytes(data))
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    except Exception as exc:  # safetensors raises several types on garbage
        raise CorruptEntryError(f"undecodable entry ({type(exc).__name__}: {str(exc)[:100]})") from None
    if meta.get("magic") != _MAGIC or meta.get("format") != FORMAT_VERSION:
        raise CorruptEntryError(f"not a kvrag entry of format {FORMAT_VERSION}")
    keys, values = tensors.get("k"), tensors.get("v")
    if keys is None or values is None or set(tensors) != {"k", "v"}:
        raise CorruptEntryError("entry lacks its key/value tensors")
    try:
        shape, vshape = json.loads(meta["shape"]), json.loads(meta["vshape"])
    except (KeyError, ValueError):
        raise CorruptEntryError("entry header lacks its shapes") from None
    if list(keys.shape) != shape or list(values.shape) != vshape or keys.dim() != 4:
        raise CorruptEntryError("entry shape does not match its header")
    if _checksum(keys, values) != meta.get("checksum"):
        raise CorruptEntryError("entry checksum mismatch")
    user_meta = {k: v for k, v in meta.items() if k not in {"magic", "format", "shape", "vshape", "checksum"}}
    return KVEntry(keys=keys, values=values, meta=user_meta)
