"""KVLink's adapter: the file, checking it fits a model, and merging its weights (the link tokens' attention
picture and embeddings are `kvrag.fuse.links`).

Adapter artifact: one safetensors file holding the link embeddings (`links`, [max_chunks, K,
hidden]), LoRA factors (`lora.<module>.A/B`, mode `lora`) or model weights (`model.<name>`, mode
`full`), with a JSON header (safetensors metadata key `kvrag_link_adapter`): the base model's
fingerprint and its dtype-free identity, K, the mode, the layout version and identity, the training
configuration and the data provenance. Loading it over another base model or layout raises
`AdapterMismatchError`. An adapter that changes weights (lora, full) changes the model: the engine
serves a merged copy whose fingerprint folds in the adapter's digest, so its chunk caches are its
own and never mixed with the base model's.
"""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvrag.errors import AdapterMismatchError
from kvrag.kv.layout import LAYOUT_VERSION
from kvrag.model.loading import LoadedModel, architecture_identity, text_config
from kvrag.defaults import BASE_CHUNK_MODES, LINK_MODES as MODES
from kvrag.defaults import SHIPPED_SPECS, names_no_adapter  # noqa: F401 (re-exported: the words that name adapters)
from kvrag.fuse.links import default_link_embeds, link_rows
from kvrag.version import __version__

log = logging.getLogger(__name__)

ADAPTER_FORMAT = "kvrag-link-adapter"
ADAPTER_FORMAT_VERSION = 1
HEADER_KEY = "kvrag_link_adapter"

SHIPPED_DIR = Path(__file__).parent / "adapters"
# Adapters shipped in the package, per model source and kind: "tuned" changes the weights (LoRA;
# `link_adapter="tuned"`: kvlink answers over a merged copy, every other method over the base
# weights), "links" leaves them as they are (only the link embeddings; `link_adapter="auto"` or
# "links"). A missing file is skipped.
SHIPPED_ADAPTERS: dict[str, dict[str, str]] = {
    "bundled:smollm2-135m-instruct": {
        "tuned": "smollm2-135m-instruct.kvlink-lora.safetensors",
        "links": "smollm2-135m-instruct.kvlink.safetensors",
    }
}
SHIPPED_KINDS = ("tuned", "links")
MERGED_SUFFIX = "-adapter"  # ends the source of a model with an adapter merged in ("...+lora-adapter")


# -- identity ------------------------------------------------------------------------------------
def base_identity(model: Any) -> str:
    """The base weights' identity whatever their dtype: model_fingerprint's architecture fields
    and weight samples, without the dtype and with the samples rounded to bfloat16.

    An adapter trained on the fp32 model is then accepted over the same model loaded in bf16 on a GPU.
    """
    h = hashlib.sha256()
    ident = architecture_identity(model)
    h.update(json.dumps(ident, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // 64)
            sample = flat[::step][:64].to("cpu", torch.bfloat16).float().contiguous()
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]


# -- the adapter ---------------------------------------------------------------------------------
@dataclass
class LinkAdapter:
    """Link embeddings (+ LoRA factors or full weights) and the header that says what they fit."""

    embeds: torch.Tensor  # [max_chunks, K, hidden], float32
    mode: str = "links"
    lora: dict[str, torch.Tensor] = field(default_factory=dict)  # "<module>.A" [r, in], "<module>.B" [out, r]
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # mode "full": parameter name -> tensor
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"adapter mode must be one of {MODES}, got {self.mode!r}")
        if self.embeds.dim() != 3:
            raise ValueError("link embeddings must be shaped [max_chunks, link_tokens, hidden]")

    @property
    def link_tokens(self) -> int:
        return int(self.embeds.shape[1])

    @property
    def max_chunks(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def changes_model(self) -> bool:
        return bool(self.lora or self.weights)

    @property
    def reads_base_chunks(self) -> bool:
        """Whether kvlink reads the base weights' chunk KV with this adapter (links; LoRA trained only at the
        positions after the chunks): then the chunks are stored once, for every method."""
        return self.mode in BASE_CHUNK_MODES

    def rows(self, n_chunks: int) -> torch.Tensor:
        return link_rows(self.embeds, n_chunks)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"links": self.embeds}
        out.update({f"lora.{k}": v for k, v in self.lora.items()})
        out.update({f"model.{k}": v for k, v in self.weights.items()})
        return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}

    def digest(self) -> str:
        """sha256 over the mode and every tensor (link rows included): names this adapter in a calibration.
        Computed once (an adapter's tensors are not changed after loading): every request that names no
        method asks for it."""
        memo = self.__dict__.get("_digest")
        if memo is not None:
            return memo
        h = hashlib.sha256(self.mode.encode())
        for name, t in sorted(self.tensors().items()):
            h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        self.__dict__["_digest"] = h.hexdigest()[:32]
        return self.__dict__["_digest"]

    def weights_digest(self) -> str:
        """sha256 over the tensors that change the model (LoRA factors, full weights); '' for links only."""
        if not self.changes_model:
            return ""
        h = hashlib.sha256()
        for name, t in sorted(self.tensors().items()):
            if name == "links":
                continue
            h.update(name.encode())
            h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()[:32]


def adapter_header(
    lm: LoadedModel,
    link_tokens: int,
    mode: str,
    layout_identity: str | None = None,
    lora: Mapping[str, Any] | None = None,
    training: Mapping[str, Any] | None = None,
    data: list[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON header an adapter trained on `lm` carries."""
    return {
        "format": ADAPTER_FORMAT,
        "format_version": ADAPTER_FORMAT_VERSION,
        "base_fingerprint": lm.fingerprint,
        "base_identity": base_identity(lm.model),
        "base_source": lm.source,
        "base_dtype": str(lm.dtype),
        "link_tokens": int(link_tokens),
        "mode": mode,
        "layout_version": LAYOUT_VERSION,
        "layout_identity": layout_identity,
        "lora": dict(lora) if lora else None,
        "training": dict(training or {}),
        "data": list(data or []),
        "kvrag_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def save_adapter(path: str | os.PathLike, adapter: LinkAdapter) -> Path:
    """Write the adapter as one safetensors file (atomically: temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(adapter.meta)
    meta.setdefault("format", ADAPTER_FORMAT)
    meta.setdefault("format_version", ADAPTER_FORMAT_VERSION)
    meta["mode"] = adapter.mode
    meta["link_tokens"] = adapter.link_tokens
    meta["max_chunks"] = adapter.max_chunks
    meta["weights_digest"] = adapter.weights_digest()
    fd, tmp = tempfile.mkstemp(prefix=".adapter-", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        save_file(adapter.tensors(), tmp, metadata={HEADER_KEY: json.dumps(meta, sort_keys=True)})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # an adapter is meant to be shared and packaged: not mkstemp's 0600
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read_adapter_header(path: str | os.PathLike) -> dict[str, Any]:
    """The adapter's JSON header, without loading its tensors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"link adapter not found: {path}")
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(HEADER_KEY)
    if raw is None:
        raise AdapterMismatchError(f"{path} is not a kvrag link adapter (no {HEADER_KEY!r} header)")
    meta = json.loads(raw)
    if meta.get("format") != ADAPTER_FORMAT or int(meta.get("format_version", 0)) > ADAPTER_FORMAT_VERSION:
        raise AdapterMismatchError(f"{path}: unsupported adapter format {meta.get('format')!r} v{meta.get('format_version')}")
    return meta


def load_adapter(path: str | os.PathLike, lm: LoadedModel | None = None, layout_identity: "str | Mapping[str, str] | None" = None) -> LinkAdapter:
    """Read an adapter file; with `lm` (and `layout_identity`) check that it was trained for them."""
    meta = read_adapter_header(path)
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            tensors[key] = f.get_tensor(key)
    if "links" not in tensors:
        raise AdapterMismatchError(f"{path}: no link embeddings in the adapter")
    adapter = LinkAdapter(
        embeds=tensors.pop("links"),
        mode=meta.get("mode", "links"),
        lora={k[len("lora.") :]: v for k, v in tensors.items() if k.startswith("lora.")},
        weights={k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")},
        meta=meta,
    )
    if meta.get("weights_digest", "") != adapter.weights_digest():
        raise AdapterMismatchError(f"{path}: the adapter's weights do not match its header's digest (corrupt file?)")
    if lm is not None:
        check_adapter(adapter, lm, layout_identity, where=str(path))
    return adapter


def check_adapter(adapter: LinkAdapter, lm: LoadedModel, layout_identity: "str | Mapping[str, str] | None" = None,
                  where: str = "link adapter") -> None:
    """Raise AdapterMismatchError unless the adapter was trained for this base model (any dtype) and layout.
    `layout_identity`: the layout's identity, or its identity under each layout version it is built the same
    way in (`PromptLayout.adapter_identities`)."""
    meta = adapter.meta
    if lm.source.endswith(MERGED_SUFFIX) and meta.get("base_fingerprint") != lm.fingerprint:
        raise AdapterMismatchError(
            f"{where}: this model ({lm.source}) has a link adapter merged in already; pass the base model "
            "(or `rag.with_store(...)` for another engine over the same prepared model)"
        )
    if meta.get("base_fingerprint") != lm.fingerprint and meta.get("base_identity") != base_identity(lm.model):
        raise AdapterMismatchError(
            f"{where} was trained for another base model (fingerprint {meta.get('base_fingerprint')}, "
            f"{meta.get('base_source')}) than this one ({lm.fingerprint}, {lm.source}); "
            "train one for this model with `kvrag train-links --model ...`"
        )
    identities = layout_identity if isinstance(layout_identity, Mapping) else None
    version = meta.get("layout_version")
    if (version not in identities) if identities is not None else (version != LAYOUT_VERSION):
        raise AdapterMismatchError(
            f"{where} was trained with prompt layout version {version}, this kvrag uses {LAYOUT_VERSION}; retrain it"
        )
    expected = identities[version] if identities is not None else layout_identity
    if expected is not None and meta.get("layout_identity") not in (None, expected):
        raise AdapterMismatchError(
            f"{where} was trained with another prompt layout (instruction, place of the documents / chat template: "
            f"{meta.get('layout_identity')}) than this engine's ({expected}); use the layout it was trained with or retrain it"
        )
    hidden = text_config(lm.model).hidden_size
    if adapter.embeds.shape[-1] != hidden:
        raise AdapterMismatchError(f"{where}: link embeddings are {adapter.embeds.shape[-1]}-wide, the model's hidden size is {hidden}")


def lora_scaling(adapter: LinkAdapter) -> float:
    cfg = adapter.meta.get("lora") or {}
    if "scaling" in cfg:
        return float(cfg["scaling"])
    return float(cfg.get("alpha", cfg.get("r", 1))) / float(cfg.get("r", 1))


@torch.no_grad()
def merge_weights(model: Any, adapter: LinkAdapter) -> Any:
    """Fold the adapter's LoRA factors (W += scaling * B @ A) or full weights into `model`, in place."""
    if adapter.weights:
        params = dict(model.named_parameters())
        for name, value in adapter.weights.items():
            if name not in params:
                raise AdapterMismatchError(f"adapter weight {name!r} is not a parameter of this model")
            params[name].copy_(value.to(params[name].device, params[name].dtype))
    if adapter.lora:
        scale = lora_scaling(adapter)
        modules = {n for n in (k.rsplit(".", 1)[0] for k in adapter.lora)}
        for name in sorted(modules):
            try:
                layer = model.get_submodule(name)
            except AttributeError:
                raise AdapterMismatchError(f"adapter LoRA module {name!r} is not in this model") from None
            a, b = adapter.lora[f"{name}.A"].float(), adapter.lora[f"{name}.B"].float()
            w = layer.weight
            w.copy_((w.float() + scale * (b.to(w.device) @ a.to(w.device))).to(w.dtype))
    return model


def apply_adapter(lm: LoadedModel, adapter: LinkAdapter, inplace: bool = False) -> LoadedModel:
    """The model KVLink serves with this adapter: `lm` itself (links only) or a merged copy (lora, full).

    The merged model's fingerprint folds in the adapter's weight digest: its chunk caches are keyed
    apart from the base model's, so no KV computed by the base model is ever read for it.
    """
    if not adapter.changes_model:
        return lm
    model = lm.model if inplace else _copy_for_merge(lm.model, adapter)
    merge_weights(model, adapter)
    model.train(False)
    # the base weights' fingerprint (dtype included) and the adapter's digest name the merged weights:
    # no second pass over the weights (~0.5 s on the bundled model)
    fp = hashlib.sha256(f"{lm.fingerprint}:link-adapter:{adapter.weights_digest()}".encode()).hexdigest()[:32]
    return LoadedModel(model=model, tokenizer=lm.tokenizer, fingerprint=fp, source=f"{lm.source}+{adapter.mode}{MERGED_SUFFIX}")


def _copy_for_merge(model: Any, adapter: LinkAdapter) -> Any:
    """A copy of `model` whose parameters the adapter changes are its own; every other parameter is
    shared with `model` (the engine keeps the base weights for Full Attention beside the merged ones
    for kvlink without a second copy of the untouched weights)."""
    changed = set(adapter.weights) | {f"{name}.weight" for name in (k.rsplit(".", 1)[0] for k in adapter.lora)}
    memo = {id(p): p for name, p in model.named_parameters() if name not in changed}
    return copy.deepcopy(model, memo)


def shipped_adapter_paths(lm: LoadedModel, kinds: tuple[str, ...] = SHIPPED_KINDS) -> list[Path]:
    """The adapter files shipped inside the package for this model (the bundled SmolLM2), of these
    kinds in this order, that are there."""
    names = SHIPPED_ADAPTERS.get(lm.source, {})
    paths = [SHIPPED_DIR / names[k] for k in kinds if k in names]
    return [p for p in paths if p.is_file()]


def resolve_link_rows(
    lm: LoadedModel, adapter: LinkAdapter | None, link_tokens: int | None, n_chunks: int, defaults: dict[int, torch.Tensor] | None = None
) -> tuple[int, torch.Tensor | None]:
    """K and the [n_chunks * K, hidden] link embeddings of one prompt (None when K = 0).

    `link_tokens=None` takes the adapter's K (0 without an adapter: KVLink-0, i.e. Full Reuse).
    A K other than the adapter's is an error; with no adapter, K > 0 uses untrained (mean) rows.
    """
    k = (adapter.link_tokens if adapter is not None else 0) if link_tokens is None else int(link_tokens)
    if k < 0:
        raise ValueError(f"link_tokens must be >= 0, got {k}")
    if k == 0:
        return 0, None
    if adapter is not None:
        if adapter.link_tokens != k:
            raise ValueError(f"link_tokens={k} but the link adapter was trained with {adapter.link_tokens} link tokens")
        table = adapter.embeds
    else:
        cache = defaults if defaults is not None else {}
        if k not in cache:
            log.warning("kvlink with %d link tokens and no link adapter: the link embeddings are untrained (mean embedding)", k)
            cache[k] = default_link_embeds(lm.model, k)
        table = cache[k]
    return k, link_rows(table, n_chunks).to(lm.device, lm.dtype)
