"""Entry serialisation: safetensors (no Python object serialisation) with a versioned header and a checksum.

Layout: the safetensors header's metadata carries `magic`, `format`, the shapes, the original
dtype, the quantisation and a CRC32 over every tensor's bytes; tensors are `k`/`v` (or their
int8 form `k_q`,`k_scale`,`v_q`,`v_scale`) and optionally `ids`, the chunk's token ids, which
make an entry self-contained.

Optional int8 storage (KIVI-style): keys are quantised per channel (one scale per layer, head and
head-dim channel, over the tokens), values per token (one scale per layer, head and token, over
the channels). Symmetric, round-to-nearest: every element is within scale/2 = max|group|/254 of
its original, where the group is that channel (keys) or that token (values).

Decoding untrusted bytes either returns a well-formed entry or raises CorruptEntryError.
"""

from __future__ import annotations

import json
import zlib

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .base import CorruptEntryError, KVEntry

FORMAT_VERSION = "2"
_MAGIC = "kvrag-entry"
_RESERVED = {"magic", "format", "shape", "vshape", "dtype", "quant", "checksum"}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        crc = zlib.crc32(name.encode(), crc)
        if t.numel():
            crc = zlib.crc32(t.view(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def quantize_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over `dim` (the reduced axis): returns (int8 values, float32 scales with dim kept)."""
    xf = x.float()
    scale = xf.abs().amax(dim=dim, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(xf / scale), -127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def encode_entry(entry: KVEntry, quantize: bool = False) -> bytes:
    keys = entry.keys.detach().to("cpu").contiguous()
    values = entry.values.detach().to("cpu").contiguous()
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"entry tensors must be [layers, heads, tokens, dim]; got {tuple(keys.shape)} / {tuple(values.shape)}")
    dtype = str(keys.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported entry dtype {keys.dtype}")
    if quantize:
        kq, ks = quantize_int8(keys, dim=2)  # per channel: reduce over tokens
        vq, vs = quantize_int8(values, dim=3)  # per token: reduce over channels
        tensors = {"k_q": kq, "k_scale": ks, "v_q": vq, "v_scale": vs}
    else:
        tensors = {"k": keys, "v": values}
    if entry.token_ids is not None:
        tensors["ids"] = entry.token_ids.detach().to("cpu", torch.int64).contiguous().view(-1)
    meta = {str(k): str(v) for k, v in entry.meta.items() if k not in _RESERVED}
    meta.update(
        magic=_MAGIC,
        format=FORMAT_VERSION,
        shape=json.dumps(list(keys.shape)),
        vshape=json.dumps(list(values.shape)),
        dtype=dtype,
        quant="int8" if quantize else "none",
        checksum=_checksum(tensors),
    )
    return st_save(tensors, metadata=meta)


def _header(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]).get("__metadata__") or {}


def decode_entry(data: bytes) -> KVEntry:
    try:
        data = bytes(data)
        tensors = st_load(data)
        meta = _header(data)
        shape, vshape = json.loads(meta["shape"]), json.loads(meta["vshape"])
        dtype = _DTYPES[meta["dtype"]]
        quant = meta["quant"]
    except Exception as exc:  # safetensors and json raise several types on garbage
        raise CorruptEntryError(f"undecodable entry ({type(exc).__name__}: {str(exc)[:100]})") from None
    if meta.get("magic") != _MAGIC or meta.get("format") != FORMAT_VERSION:
        raise CorruptEntryError(f"not a kvrag entry of format {FORMAT_VERSION}")
    expected = {"k", "v"} if quant == "none" else {"k_q", "k_scale", "v_q", "v_scale"} if quant == "int8" else None
    if expected is None or not expected <= set(tensors) or set(tensors) - expected - {"ids"}:
        raise CorruptEntryError("entry tensors do not match its header")
    if _checksum(tensors) != meta.get("checksum"):
        raise CorruptEntryError("entry checksum mismatch")
    try:
        if quant == "none":
            keys, values = tensors["k"], tensors["v"]
        else:
            keys = dequantize_int8(tensors["k_q"], tensors["k_scale"], dtype)
            values = dequantize_int8(tensors["v_q"], tensors["v_scale"], dtype)
    except RuntimeError as exc:  # scale shapes that do not broadcast
        raise CorruptEntryError(f"entry tensors inconsistent: {exc}") from None
    if list(keys.shape) != shape or list(values.shape) != vshape or keys.dim() != 4 or keys.dtype != dtype:
        raise CorruptEntryError("entry shape or dtype does not match its header")
    ids = tensors.get("ids")
    if ids is not None and ids.numel() != shape[2]:
        raise CorruptEntryError("entry token ids do not match its length")
    user_meta = {k: v for k, v in meta.items() if k not in _RESERVED}
    return KVEntry(keys=keys, values=values, meta=user_meta, token_ids=ids)
