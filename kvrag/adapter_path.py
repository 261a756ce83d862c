"""kvlink's fast path over a link adapter's merged weights, beside a base engine (`KVRag` routes kvlink to it;
calibration measures kvlink with it without an engine)."""

from __future__ import annotations

from kvrag.core import KVRagCore
from kvrag.defaults import DEFAULT_RATIO, DefaultSetting
from kvrag.kv.repository import Resolved
from kvrag.link_adapter import LinkAdapter
from kvrag.model.loading import LoadedModel
from kvrag.options import TUNED_METHOD
from kvrag.pipeline import RequestPipeline

ADAPTER_DEFAULT = DefaultSetting(TUNED_METHOD, DEFAULT_RATIO, "adapter", "a weight-changing link adapter was asked for")


class AdapterPath(KVRagCore):
    """kvlink's fast path over merged weights: the base engine's store, layout and chunk registry, and
    its own chunk KV (keys from the merged fingerprint), or, for a LoRA trained only at the positions
    after the chunks (mode lora-after), the base engine's chunk KV read by the merged weights."""

    def __init__(self, lm: LoadedModel, base: KVRagCore, adapter: LinkAdapter) -> None:
        super().__init__(lm, store=base.store, layout=base.layout, batch_size=base.batch_size)
        self.repo.chunks = base.repo.chunks  # one registry: ids registered through either path resolve in both
        self._adapter = adapter
        self.shares_chunks = adapter.reads_base_chunks
        if self.shares_chunks:  # the base weights encode (and key) the chunks; the merged ones read the prompt and decode
            self.repo = base.repo
            self.pipeline = RequestPipeline(base.repo, self.rotary, lambda: self.link_adapter, self.prefix_cache, lm=lm)

    @property
    def link_adapter(self) -> LinkAdapter:
        return self._adapter

    @property
    def default_setting(self) -> DefaultSetting:
        return ADAPTER_DEFAULT

    def rekey(self, resolved: Resolved) -> Resolved:
        """The base path's resolved chunks (ids looked up there, token ids known) keyed for these weights."""
        if self.shares_chunks:
            return resolved
        return Resolved(chunks=resolved.chunks, token_ids=resolved.token_ids, keys=[self.repo.chunk_key(ids, resolved.salt) for ids in resolved.token_ids],
                        whole=resolved.whole, salt=resolved.salt)
