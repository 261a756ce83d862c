"""The only module that touches transformers' Cache API (written against transformers 5.x).

`SpliceCache` holds a stitched KV sequence. During the recompute pass the first `n` new entries
of every layer overwrite given positions (the recomputed chunk tokens) and the rest are appended
(the question); afterwards it behaves like a DynamicCache and grows by appending while decoding.
The stock decoder layers then do the recompute work for any Llama/Qwen/Mistral-style model.

Also here: `SlotCache` (fixed buffers for static decoding), the layer-stack helpers (chunk KV as
[layers, kv_heads, tokens, head_dim] pairs) and `cache_arg` (the keyword a model's forward takes its
cache by).
"""

from __future__ import annotations

import inspect
from functools import lru_cache, partial
from typing import Any, Callable, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

KV = tuple[torch.Tensor, torch.Tensor]


class SpliceLayer(DynamicLayer):
    """A DynamicLayer that can overwrite positions in place before appending, and appends into
    reserved room instead of concatenating (decoding writes one token per step into the buffer).

    `keys`/`values` are always views of the first `length` slots of the buffers; when the room runs
    out the buffers grow by the reserve hint (or what is needed) at once, never per token.
    """

    GROW = 256  # slots added when the room runs out and no reserve hint was given

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, reserve: int = 0, length: int | None = None) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        n = keys.shape[-2] if length is None else length
        if length is None and reserve > 0:
            keys, values = _with_room(keys, n, n + reserve), _with_room(values, n, n + reserve)
        self._kbuf, self._vbuf, self._len = keys, values, n
        self._reserve = reserve
        self.keys, self.values = keys[..., :n, :], values[..., :n, :]
        self.overwrite_at: torch.Tensor | None = None
        self.mode = "overwrite"
        self.exact: torch.Tensor | None = None  # bool per overwritten slot: always overwrite, never blend
        # called once, on this layer's first update, before its KV is written or read: a layer-wise
        # feed (kvrag.fuse.layer_feed) fills the layer's stitched KV only when the pass reaches it
        self.ready: Callable[[], None] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KV:
        if self.ready is not None:
            ready, self.ready = self.ready, None
            ready()
        idx = self.overwrite_at
        if idx is not None and idx.numel():
            n = idx.numel()
            new_k, new_v = key_states[:, :, :n].to(self.keys.dtype), value_states[:, :, :n].to(self.values.dtype)
            if self.mode == "fusion":
                fused_k = fuse_by_cosine(new_k, self.keys.index_select(2, idx))
                fused_v = fuse_by_cosine(new_v, self.values.index_select(2, idx))
                if self.exact is not None and bool(self.exact.any()):
                    keep_new = self.exact.to(new_k.device)[None, None, :, None]
                    fused_k, fused_v = torch.where(keep_new, new_k, fused_k), torch.where(keep_new, new_v, fused_v)
                new_k, new_v = fused_k, fused_v
            self.keys.index_copy_(2, idx, new_k)
            self.values.index_copy_(2, idx, new_v)
            key_states, value_states = key_states[:, :, n:], value_states[:, :, n:]
        if key_states.shape[-2]:
            self._append(key_states, value_states)
        return self.keys, self.values

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        n, add = self._len, key_states.shape[-2]
        if n + add > self._kbuf.shape[-2]:
            cap = n + add + max(self._reserve, self.GROW)
            self._kbuf, self._vbuf = _with_room(self._kbuf, n, cap), _with_room(self._vbuf, n, cap)
        self._kbuf[..., n : n + add, :] = key_states
        self._vbuf[..., n : n + add, :] = value_states
        self._len = n + add
        self.keys, self.values = self._kbuf[..., : self._len, :], self._vbuf[..., : self._len, :]

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._len = self.keys.shape[-2]

    def room(self, capacity: int) -> KV:
        """This layer's buffers, grown once if they hold fewer than `capacity` slots (static decoding
        writes into them at fixed shapes; the first `length` slots are this layer's KV)."""
        if self._kbuf.shape[-2] < capacity:
            self._kbuf, self._vbuf = _with_room(self._kbuf, self._len, capacity), _with_room(self._vbuf, self._len, capacity)
            self.keys, self.values = self._kbuf[..., : self._len, :], self._vbuf[..., : self._len, :]
        return self._kbuf, self._vbuf

    def adopt(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int) -> None:
        """Hold the first `length` slots of these buffers, the rest as room (after static decoding)."""
        self._kbuf, self._vbuf, self._len = kbuf, vbuf, length
        self.keys, self.values = kbuf[..., :length, :], vbuf[..., :length, :]


def _with_room(t: torch.Tensor, n: int, capacity: int) -> torch.Tensor:
    """A [..., capacity, d] buffer whose first n slots are t's."""
    buf = t.new_empty(*t.shape[:-2], capacity, t.shape[-1])
    buf[..., :n, :] = t[..., :n, :]
    return buf


class SpliceCache(Cache):
    """A cache over stitched per-layer KV; see the module docstring."""

    def __init__(
        self, kv: Sequence[KV], reserve: int = 0, lengths: Sequence[int] | None = None, ready: Callable[[int], None] | None = None
    ) -> None:
        """`kv`: per-layer [1, kv_heads, slots, d] tensors, taken as they are (no copy) unless room
        must be made; `reserve`: slots to keep free for the question and the answer. With `lengths`,
        each layer's tensors are buffers whose first `lengths[i]` slots hold the context (already with room).
        `ready(i)`: called before layer i's first update (a layer-wise feed filling layer i's KV)."""
        if lengths is None:
            layers = [SpliceLayer(k, v, reserve) for k, v in kv]
        else:
            layers = [SpliceLayer(k, v, reserve, n) for (k, v), n in zip(kv, lengths)]
        if ready is not None:
            for i, layer in enumerate(layers):
                layer.ready = partial(ready, i)
        super().__init__(layers=layers)

    def overwrite(self, slots: torch.Tensor | None, mode: str = "overwrite", exact: torch.Tensor | None = None) -> None:
        """The next forward's first len(slots) tokens write into these slots (None: append only).

        mode "overwrite" replaces the old KV; "fusion" blends new and old by their cosine (SamKV eq. 4),
        except where `exact` (bool per slot) is set: those slots (KVLink link slots, empty before
        the pass) are overwritten in either mode.
        """
        if mode not in ("overwrite", "fusion"):
            raise ValueError(f"update mode must be 'overwrite' or 'fusion', got {mode!r}")
        for layer in self.layers:
            layer.overwrite_at = slots
            layer.mode = mode
            layer.exact = exact


def fuse_by_cosine(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """theta * new + (1 - theta) * old with theta = cos(new, old) per head and token (SamKV eq. 4)."""
    theta = torch.nn.functional.cosine_similarity(new.float(), old.float(), dim=-1).unsqueeze(-1)
    return (theta * new.float() + (1 - theta) * old.float()).to(new.dtype)


def prefix_cache(kv: Sequence[KV], reserve: int = 0) -> Cache:
    """A cache holding copies of `kv` (the stored tensors are never written through), with room for
    `reserve` more slots so the prompt and the answer append without reallocating."""
    if reserve > 0:
        return SpliceCache([(_with_room(k, k.shape[-2], k.shape[-2] + reserve), _with_room(v, v.shape[-2], v.shape[-2] + reserve)) for k, v in kv],
                           reserve, [k.shape[-2] for k, _ in kv])
    return DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in kv])


def decoding_cache(kv: Sequence[KV], reserve: int = 0) -> Cache:
    """A cache over these tensors (no copy) for decoding, with room for `reserve` new tokens."""
    return SpliceCache(kv, reserve)


def cache_from_kv(kv: Sequence[KV]) -> DynamicCache:
    """A DynamicCache over these tensors as they are (no copy)."""
    return DynamicCache(ddp_cache_data=list(kv))


def cache_nbytes(cache: Cache) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in cache_kv(cache))


def empty_cache() -> DynamicCache:
    return DynamicCache()


def cache_kv(cache: Cache) -> list[KV]:
    """Per-layer (keys, values) of any attention cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def layer_kv(cache: Cache, layer: int) -> KV:
    """(keys, values) of one layer: [batch, kv_heads, slots, d]."""
    entry = cache.layers[layer]
    return entry.keys, entry.values


def cache_len(cache: Cache) -> int:
    return int(cache.get_seq_length())


@lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_arg(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword a model's forward takes its Cache by: `cache` where the model names it (transformers
    5.24 on, where `past_key_values` is deprecated), else `past_key_values` (5.0-5.23, and wrappers such
    as PEFT whose forward takes **kwargs: their base model decides)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return {_cache_keyword(type(base)): cache}


# -- layer stacks: how chunk KV is stored and stitched ---------------------------------------------
LayerStack = tuple[torch.Tensor, torch.Tensor]  # keys, values: [layers, kv_heads, tokens, head_dim]


def stack_layers(kv: Sequence[KV], start: int = 0, end: int | None = None, row: int = 0) -> LayerStack:
    """Per-layer [batch, h, t, d] tensors -> one [layers, h, t, d] pair for batch row `row`."""
    keys = torch.stack([k[row, :, start:end] for k, _ in kv])
    values = torch.stack([v[row, :, start:end] for _, v in kv])
    return keys, values


def unstack_layers(keys: torch.Tensor, values: torch.Tensor) -> list[KV]:
    """[layers, h, t, d] -> per-layer [1, h, t, d] views."""
    return [(keys[i : i + 1], values[i : i + 1]) for i in range(keys.shape[0])]


# -- static decoding (kvrag.decode.static): fixed buffers, the write slot a tensor ---------------------
class SlotLayer(CacheLayerMixin):
    """A layer over fixed [1, kv_heads, capacity, d] buffers: `update` writes the step's K/V at the
    shared `slot` tensor and returns the whole buffers (the mask hides what is not written yet)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.slot = keys, values, slot
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the buffers exist before the first step."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> KV:
        self.keys.index_copy_(2, self.slot, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, self.slot, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_seq_length(self) -> int:
        """The capacity (a fixed number; the tokens held are only known as the `slot` tensor)."""
        return self.keys.shape[-2]

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class SlotCache(Cache):
    """The static cache a `StaticStep` decodes into: one `SlotLayer` per model layer."""

    def __init__(self, buffers: Sequence[KV], slot: torch.Tensor) -> None:
        super().__init__(layers=[SlotLayer(k, v, slot) for k, v in buffers])
