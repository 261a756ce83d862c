"""Entry serialisation: a safetensors-compatible file, decoded as zero-copy views, with an xxh3 checksum.

Layout (format 3), which any safetensors reader also accepts:

    u64 little-endian header length N | N bytes of JSON header, space-padded so 8+N is a multiple of 64 | data

The header's `__metadata__` carries `magic`, `format`, the shapes, the original dtype, the
quantisation and `checksum`: xxh3_64 over the header text as written (less its padding, with the
checksum's 16 hex digits read as zeros) followed by the whole data region, so a flipped byte
anywhere -- tensor table, user metadata or data -- is detected. Tensors are `k`/`v` (or their int8 form `k_q`,`k_scale`,`v_q`,`v_scale`) and
optionally `ids`, the chunk's token ids, laid out by element size, largest first, so each tensor's
offset is a multiple of its element size and the decoder can take aligned views.

`decode_entry(buf)` takes a uint8 tensor (the buffer a disk read landed in) and returns tensors that
*view* it: no intermediate bytes object and no second host copy. The tensors keep the buffer alive;
the buffer is never reused while any of them exists (see host.BufferPool). Given bytes, it makes
one aligned copy first. Every length read from the header is bounded before anything is allocated.
A reader that hashes as it reads splits the decode: `prepare_entry` (tensor table, views, header
fields: no data needed, so it can run once the header is in) and `finish_entry` (the checksum
comparison, then any deferred fault; int8 is dequantised only from verified bytes).

Storage precision (`storage_of`): "none" keeps the entry's own dtype (the model's compute dtype: a
store never widens it); "bf16" keeps a float32 entry as bfloat16 (half the bytes; the same exponent
range, 8 mantissa bits) and widens it back on read; float16/bfloat16 entries are already at most that
and are kept as they are. Optional int8 storage (KIVI-style): keys are quantised per channel (one scale per layer, head and
head-dim channel, over the tokens), values per token (one scale per layer, head and token, over
the channels). Symmetric, round-to-nearest: every element is within scale/2 = max|group|/254 of
its original, where the group is that channel (keys) or that token (values).

Decoding untrusted bytes either returns a well-formed entry or raises CorruptEntryError; an entry
of an older format raises StaleEntryError (a CorruptEntryError), which stores treat as a clean miss.

Keyed entries (`MacKey`, from `$KVRAG_STORE_KEY` or a store's `key=`). The checksum is unkeyed: it
catches accidental damage (truncation, bit flips, partial writes), but whoever can write the store
can also recompute it, e.g. relabel one chunk's KV with another chunk's token ids. With a key, a
writer also puts `mac` in the header: HMAC-SHA256 under the key over the store key the entry is
written under, the header text (the `checksum` and `mac` values read as zeros) and every data byte,
each length-prefixed. A reader holding the key checks the MAC in place of the checksum (one pass,
SHA-256, ~1.8 GB/s a core with SHA extensions against xxh3's ~28 GB/s): an entry without a MAC, or
whose MAC does not verify, is a CorruptEntryError. Binding the store key means a genuine entry
copied under another key is refused too. The MAC covers the data itself, not the xxh3 digest of it:
xxh3 is not collision resistant, so a writer could tune a forged entry's data to a genuine entry's
digest. The format version is unchanged: a keyed entry is still a valid format-3 entry for a reader
without the key (its checksum covers the `mac` field), and without a key everything reads as before.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from .base import CorruptEntryError, KVEntry

FORMAT_VERSION = "3"
_MAGIC = "kvrag-entry"
_RESERVED = {"magic", "format", "shape", "vshape", "dtype", "quant", "checksum", "mac"}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8, "I64": torch.int64}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_NAMES = {"k", "v", "k_q", "k_scale", "v_q", "v_scale", "ids"}
MAX_HEADER_BYTES = 1 << 20  # a real header is < 1 KiB plus user metadata
MAX_ENTRY_BYTES = 1 << 34  # 16 GiB: anything claiming more is corrupt
ALIGN = 64


class StaleEntryError(CorruptEntryError):
    """A well-formed entry of another format version: a miss, not damage."""


class UnverifiedEntryError(CorruptEntryError):
    """An entry the store key cannot vouch for: it has no MAC (written without the key) or its MAC is
    another key's (or forged). A keyed reader treats it as a miss but never deletes it: it may be
    another writer's genuine data (`kvrag store sign` re-signs it, `kvrag store gc --unverified` removes it)."""


_BLANK = "0" * 16  # the checksum field while the checksum is computed
_MAC_BLANK = "0" * 64  # the mac field while the MAC is computed
KEY_ENV = "KVRAG_STORE_KEY"


def _field(value: str, name: str = "checksum") -> bytes:
    return f'"{name}":"{value}"'.encode()


class MacKey:
    """A deployment secret that signs entries (see the module docstring); never shown in a repr."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str | bytes) -> None:
        raw = secret.encode("utf-8", "surrogatepass") if isinstance(secret, str) else bytes(secret)
        if not raw:
            raise ValueError("a store key must not be empty")
        self._secret = hashlib.sha256(b"kvrag-store-key\x00" + raw).digest()  # any length in, 32 bytes out

    def mac(self, name: str, header_text: bytes) -> "hmac.HMAC":
        """A MAC hasher fed the store key `name` and the header text (both length-prefixed): feed it the data next."""
        h = hmac.new(self._secret, digestmod="sha256")
        n = name.encode()
        h.update(len(n).to_bytes(8, "little") + n + len(header_text).to_bytes(8, "little"))
        h.update(header_text)
        return h

    def __repr__(self) -> str:
        return "MacKey(***)"


def mac_key(key: "str | bytes | MacKey | None" = None) -> MacKey | None:
    """The key a store signs and verifies entries with: `key` when given (an empty one: no key),
    else `$KVRAG_STORE_KEY` (unset or empty: no key)."""
    if isinstance(key, MacKey):
        return key
    if key is None:
        key = os.environ.get(KEY_ENV, "")
    return MacKey(key) if key else None


def entry_bytes_bound(tokens: int, layers: int, kv_heads: int, head_dim: int, element_size: int) -> int:
    """The largest entry a model can write: `tokens` (its context) of keys and values, the token ids,
    and room for the header and alignment. A store refuses anything larger before reading it."""
    return tokens * layers * 2 * kv_heads * head_dim * element_size + tokens * 8 + MAX_HEADER_BYTES + 8 + 2 * ALIGN


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def quantize_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over `dim` (the reduced axis): returns (int8 values, float32 scales with dim kept)."""
    xf = x.float()
    scale = xf.abs().amax(dim=dim, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(xf / scale), -127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


STORAGE = ("none", "bf16", "int8")  # a store's `quantize=` values: the precision entries are kept at


def storage_of(quantize: bool | str | None) -> str:
    """A store's storage precision from its `quantize` setting: False/None/"none", "bf16", True/"int8"."""
    if quantize is None or quantize is False:
        return "none"
    if quantize is True:
        return "int8"
    value = str(quantize).lower()
    if value in ("none", "0", "false", "no", "off"):
        return "none"
    if value in ("int8", "1", "true", "yes"):
        return "int8"
    if value in ("bf16", "bfloat16"):
        return "bf16"
    raise ValueError(f"quantize must be one of {', '.join(STORAGE)}, got {quantize!r}")


def stored_bytes_per_token(layers: int, kv_heads: int, head_dim: int, element_size: int, quantize: bool | str | None) -> float:
    """Bytes one token's KV takes in a store at this precision (keys and values, every layer; int8 adds
    its per-token value scales; the per-channel key scales are amortised over a chunk and left out)."""
    storage = storage_of(quantize)
    width = {"none": element_size, "bf16": min(element_size, 2), "int8": 1}[storage]
    per_token = layers * 2 * kv_heads * head_dim * width
    if storage == "int8":
        per_token += layers * kv_heads * 4  # one float32 value scale per layer, head and token
    return float(per_token + 8)  # + the token id


def encode_entry(entry: KVEntry, quantize: bool | str = False, key: MacKey | None = None, name: str = "") -> bytes:
    """The entry's bytes, kept at the store's precision (`storage_of(quantize)`), never wider than
    the entry's own dtype; with `key`, signed for the store key `name` it is written under."""
    storage = storage_of(quantize)
    keys = entry.keys.detach().to("cpu").contiguous()
    values = entry.values.detach().to("cpu").contiguous()
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"entry tensors must be [layers, heads, tokens, dim]; got {tuple(keys.shape)} / {tuple(values.shape)}")
    dtype = str(keys.dtype).removeprefix("torch.")
    if dtype not in _DTYPES or values.dtype != keys.dtype:
        raise ValueError(f"unsupported entry dtype {keys.dtype}/{values.dtype}")
    if storage == "bf16" and keys.dtype != torch.float32:
        storage = "none"  # float16/bfloat16 KV is already two bytes a value: kept as computed
    if storage == "int8":
        kq, ks = quantize_int8(keys, dim=2)  # per channel: reduce over tokens
        vq, vs = quantize_int8(values, dim=3)  # per token: reduce over channels
        tensors = {"k_q": kq, "k_scale": ks, "v_q": vq, "v_scale": vs}
    elif storage == "bf16":
        tensors = {"k": keys.to(torch.bfloat16), "v": values.to(torch.bfloat16)}
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
        quant=storage,
    )
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": {**meta, "checksum": _BLANK, **({"mac": _MAC_BLANK} if key else {})}}
    offset = 0
    for tname in order:
        t = tensors[tname]
        n = t.numel() * t.element_size()
        header[tname] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    if text.count(_field(_BLANK)) != 1 or (key and text.count(_field(_MAC_BLANK, "mac")) != 1):  # pragma: no cover
        raise ValueError("entry header would be ambiguous")  # user metadata is escaped inside strings
    parts = [_bytes_of(tensors[t]) for t in order]
    if key is not None:
        m = key.mac(name, text)
        for p in parts:
            m.update(p)
        text = text.replace(_field(_MAC_BLANK, "mac"), _field(m.hexdigest(), "mac"))
    h = xxhash.xxh3_64(text)
    for p in parts:
        h.update(p)
    text = text.replace(_field(_BLANK), _field(h.hexdigest()))
    text += b" " * (-(8 + len(text)) % ALIGN)
    return b"".join([len(text).to_bytes(8, "little"), text, *(p.tobytes() for p in parts)])


def as_buffer(data: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over `data`: the tensor itself, or one aligned copy of the bytes."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1 or data.device.type != "cpu":
            raise TypeError("entry buffers are 1-D uint8 CPU tensors")
        return data
    src = np.frombuffer(data, dtype=np.uint8)
    buf = torch.empty(len(src), dtype=torch.uint8)
    buf.numpy()[:] = src
    return buf


def _corrupt(msg: str) -> CorruptEntryError:
    return CorruptEntryError(msg)


def _raw(buf: torch.Tensor | np.ndarray) -> np.ndarray:
    return buf.numpy() if isinstance(buf, torch.Tensor) else buf


def parse_header(buf: torch.Tensor | np.ndarray) -> tuple[dict[str, Any], int]:
    """The JSON header and where the data starts; lengths bounded before anything is read. `buf`:
    a uint8 tensor or numpy array (a reader's, which avoids a torch call per step)."""
    raw = _raw(buf)
    size = len(raw)
    if size < 8:
        raise _corrupt(f"entry of {size} bytes has no header")
    n = int.from_bytes(raw[:8].tobytes(), "little")
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise _corrupt(f"header length {n} out of bounds (entry is {size} bytes)")
    try:
        header = json.loads(raw[8 : 8 + n].tobytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _corrupt(f"undecodable header ({str(exc)[:80]})") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise _corrupt("header is not a kvrag entry header")
    meta = header["__metadata__"]
    if meta.get("magic") != _MAGIC:
        raise _corrupt("not a kvrag entry")
    if meta.get("format") != FORMAT_VERSION:
        raise StaleEntryError(f"entry of format {str(meta.get('format'))[:10]!r}, this kvrag reads {FORMAT_VERSION}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _corrupt("entry metadata must map strings to strings")
    return header, 8 + n


def _views(buf: torch.Tensor, header: dict[str, Any], start: int) -> dict[str, torch.Tensor]:
    """Check the tensor table (names, dtypes, bounds, alignment, no gaps) and view each tensor in `buf`."""
    data_len = buf.numel() - start
    if (buf.storage_offset() + start) % 8:
        raise _corrupt("data region is not aligned")
    table = {k: v for k, v in header.items() if k != "__metadata__"}
    if set(table) - _NAMES:
        raise _corrupt("unexpected tensors in entry")
    spans = []
    for name, info in table.items():
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape, offsets = list(info["shape"]), list(info["data_offsets"])
            begin, end = offsets
        except (KeyError, TypeError, ValueError):
            raise _corrupt(f"bad tensor table entry for {name!r}") from None
        if not all(type(x) is int for x in shape + offsets):
            raise _corrupt(f"non-integer shape or offsets for {name!r}")
        if len(shape) > 8 or any(d < 0 or d > MAX_ENTRY_BYTES for d in shape):
            raise _corrupt(f"bad shape for {name!r}")
        size = dtype.itemsize
        if not (0 <= begin <= end <= data_len) or end - begin != math.prod(shape) * size or begin % size:
            raise _corrupt(f"tensor {name!r} does not fit the entry")
        spans.append((begin, end, name, dtype, shape))
    spans.sort()
    pos = 0
    for begin, end, *_ in spans:
        if begin != pos:
            raise _corrupt("tensor data overlaps or leaves gaps")
        pos = end
    if pos != data_len:
        raise _corrupt("entry length does not match its tensors")
    storage = buf.untyped_storage()
    base = buf.storage_offset() + start
    return {name: torch.empty(0, dtype=dtype).set_(storage, (base + b) // dtype.itemsize, shape) for b, e, name, dtype, shape in spans}


def checksum_start(buf: torch.Tensor | np.ndarray, header: dict[str, Any], start: int, key: MacKey | None = None, name: str = "") -> Any:
    """The entry check's hasher, fed the header text; feed it the data region next. Without `key`:
    the xxh3 checksum; with it, the MAC for the store key `name` (an entry with none is corrupt)."""
    text = _raw(buf)[8:start].tobytes().rstrip(b" ")
    meta = header["__metadata__"]
    field = _field(str(meta.get("checksum", ""))[:16])
    if text.count(field) != 1:
        raise _corrupt("entry checksum field missing or ambiguous")
    text = text.replace(field, _field(_BLANK))
    if key is None:
        return xxhash.xxh3_64(text)
    if "mac" not in meta:
        raise UnverifiedEntryError("entry has no MAC: written without the store key")
    field = _field(str(meta["mac"])[:64], "mac")
    if text.count(field) != 1:
        raise UnverifiedEntryError("entry MAC field malformed or ambiguous")
    return key.mac(name, text.replace(field, _field(_MAC_BLANK, "mac")))


def header_length(buf: torch.Tensor) -> int | None:
    """The header length a buffer's first 8 bytes claim (None if fewer than 8 bytes)."""
    return int.from_bytes(buf[:8].numpy().tobytes(), "little") if buf.numel() >= 8 else None


def decode_entry(data: bytes | bytearray | memoryview | torch.Tensor, key: MacKey | None = None, name: str = "") -> KVEntry:
    """A verified entry whose tensors view `data` (a uint8 tensor) or one copy of it (bytes); with
    `key`, only one whose MAC for the store key `name` verifies."""
    try:
        buf = as_buffer(data)
    except (TypeError, ValueError) as exc:
        raise _corrupt(f"unreadable entry buffer: {exc}") from None
    if buf.numel() > MAX_ENTRY_BYTES:
        raise _corrupt("entry larger than any valid entry")
    header, start = parse_header(buf)
    h = checksum_start(buf, header, start, key, name)
    h.update(buf.numpy()[start:])
    return decode_verified(buf, header, start, h.hexdigest(), keyed=key is not None)


def decode_verified(buf: torch.Tensor, header: dict[str, Any], start: int, digest: str, keyed: bool = False) -> KVEntry:
    """Build the entry from `buf` whose checksum (or, `keyed`, MAC) over header and data, `digest`,
    the caller computed (a reader hashes each chunk as it lands, while it is still in cache)."""
    return finish_entry(prepare_entry(buf, header, start), digest, keyed)


@dataclass(eq=False)
class PreparedEntry:
    """An entry's views into its buffer and its checked header fields, before its checksum is known."""

    meta: dict[str, str]
    tensors: dict[str, torch.Tensor]
    fields: tuple[list, list, torch.dtype, str] | None = None  # shape, vshape, dtype, quant
    entry: KVEntry | None = None  # built ahead for unquantised entries (views only: no data read)
    error: CorruptEntryError | None = None  # a header field fault: raised after the checksum comparison


def prepare_entry(buf: torch.Tensor, header: dict[str, Any], start: int) -> PreparedEntry:
    """What a decode checks without the data, so a reader can do it once the header is in, while the
    rest is still arriving: the tensor table (a fault raises here) and the header's fields (a fault
    is kept: a checksum mismatch, if any, is the better diagnosis and is raised first). The views it
    builds leave only through `finish_entry`, once the checksum matched."""
    meta = header["__metadata__"]
    p = PreparedEntry(meta, _views(buf, header, start))
    try:
        p.fields = _fields(meta, p.tensors)
        if p.fields[3] == "none":
            p.entry = _build(p.tensors, meta, *p.fields)
    except CorruptEntryError as exc:
        p.error = exc
    return p


def finish_entry(p: PreparedEntry, digest: str, keyed: bool = False) -> KVEntry:
    """The entry, once `digest` (xxh3 over the header text and every data byte, or with `keyed` the
    MAC: `checksum_start`) matches its header."""
    if keyed:
        if not hmac.compare_digest(digest.encode(), str(p.meta.get("mac", "")).encode("utf-8", "surrogatepass")):
            raise UnverifiedEntryError("entry MAC mismatch: not written with this store key")
    elif digest != p.meta.get("checksum"):
        raise _corrupt("entry checksum mismatch")
    if p.error is not None:
        raise p.error
    if p.entry is not None:
        return p.entry
    assert p.fields is not None
    return _build(p.tensors, p.meta, *p.fields)  # int8/bf16: widened only now, from verified bytes


def _fields(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> tuple[list, list, torch.dtype, str]:
    try:
        shape, vshape = json.loads(meta["shape"]), json.loads(meta["vshape"])
        dtype = _DTYPES[meta["dtype"]]
        quant = meta["quant"]
    except (KeyError, ValueError):
        raise _corrupt("entry header fields missing or malformed") from None
    expected = {"k", "v"} if quant in ("none", "bf16") else {"k_q", "k_scale", "v_q", "v_scale"} if quant == "int8" else None
    if expected is None or not expected <= set(tensors) or set(tensors) - expected - {"ids"}:
        raise _corrupt("entry tensors do not match its header")
    return shape, vshape, dtype, quant


def _build(tensors: dict[str, torch.Tensor], meta: dict[str, str], shape: list, vshape: list, dtype: torch.dtype, quant: str) -> KVEntry:
    try:
        if quant == "none":
            keys, values = tensors["k"], tensors["v"]
        elif quant == "bf16":
            if tensors["k"].dtype != torch.bfloat16 or tensors["v"].dtype != torch.bfloat16:
                raise _corrupt("bf16 entry tensors are not bfloat16")
            keys, values = tensors["k"].to(dtype), tensors["v"].to(dtype)  # widened back from verified bytes
        else:
            keys = dequantize_int8(tensors["k_q"], tensors["k_scale"], dtype)
            values = dequantize_int8(tensors["v_q"], tensors["v_scale"], dtype)
    except RuntimeError as exc:  # scale shapes that do not broadcast
        raise _corrupt(f"entry tensors inconsistent: {exc}") from None
    if list(keys.shape) != shape or list(values.shape) != vshape or keys.dim() != 4 or keys.dtype != dtype:
        raise _corrupt("entry shape or dtype does not match its header")
    if values.dtype != dtype or values.dim() != 4 or values.shape[:3] != keys.shape[:3]:
        raise _corrupt("entry values do not match its keys")
    ids = tensors.get("ids")
    if ids is not None and (ids.dtype != torch.int64 or ids.dim() != 1 or ids.numel() != shape[2]):
        raise _corrupt("entry token ids do not match its length")
    user_meta = {k: v for k, v in meta.items() if k not in _RESERVED}
    return KVEntry(keys=keys, values=values, meta=user_meta, token_ids=ids)


def sign_entry_bytes(data: bytes | bytearray | memoryview | torch.Tensor, key: MacKey, name: str) -> bytes:
    """The same entry signed with `key` for the store key `name`: the data bytes as they are, the header
    with a fresh MAC and checksum (`kvrag store sign`: a store written without the key, or with another).
    The entry's checksum must verify first (CorruptEntryError otherwise): only sound data is vouched for,
    and nothing is dequantised or re-encoded on the way."""
    buf = as_buffer(data)
    decode_entry(buf)  # every byte checked against the unkeyed checksum
    header, start = parse_header(buf)
    header["__metadata__"] = {**header["__metadata__"], "checksum": _BLANK, "mac": _MAC_BLANK}
    text = json.dumps(header, separators=(",", ":")).encode()
    if text.count(_field(_BLANK)) != 1 or text.count(_field(_MAC_BLANK, "mac")) != 1:  # pragma: no cover
        raise CorruptEntryError("entry header would be ambiguous")
    body = buf.numpy()[start:]
    m = key.mac(name, text)
    m.update(body)
    text = text.replace(_field(_MAC_BLANK, "mac"), _field(m.hexdigest(), "mac"))
    h = xxhash.xxh3_64(text)
    h.update(body)
    text = text.replace(_field(_BLANK), _field(h.hexdigest()))
    text += b" " * (-(8 + len(text)) % ALIGN)
    return b"".join([len(text).to_bytes(8, "little"), text, body.tobytes()])
