"""One options object for a request, travelling from the API through the pipeline and the integrations."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kvrag.methods.auto_ratio import AutoRatio
from kvrag.decode.stream import DecodeConfig
from kvrag.methods.snapkv import SnapKV
from kvrag.methods import Method, get_method
from kvrag.methods.alike import records_of_one_kind
from kvrag.types import Chunk

if TYPE_CHECKING:
    from kvrag.kv.registry import Resolved

from kvrag.kv.salt import salt_digest
from kvrag.kv.kinds import CHUNK_KINDS, KIND_CHUNK, KIND_PREFIX, KIND_SIMILARITY  # noqa: F401 (re-exported)

OPTION_KEYS = ("method", "recompute_ratio", "kv_kind", "evict", "min_recompute", "short_context", "records_whole", "prefix_cache",
               "cache_salt", "ape")  # AnswerOptions' own keyword fields
DECODE_KEYS = tuple(f.name for f in dataclasses.fields(DecodeConfig))  # the decode settings, as keywords

from kvrag.defaults import (  # noqa: F401 (re-exported: the request vocabulary lives in kvrag.defaults)
    Ape,
    DEFAULT_METHOD,
    DEFAULT_MIN_RECOMPUTE,
    DEFAULT_RATIO,
    DEFAULT_RECORDS_WHOLE,
    DEFAULT_SHORT_CONTEXT,
    DEFAULT_STOP_AT,
    RATIO_FREE,
    TUNED_METHOD,
    DefaultSetting,
)


def _tokens_setting(value: int | None, env_name: str, default: int) -> int:
    """A token-count option: the request's value, else the deployment's environment variable, else the default."""
    if value is not None:
        return value
    env = os.environ.get(env_name, "").strip()
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            raise ValueError(f"{env_name} must be a whole number of tokens, got {env!r}") from None
    return default


def decode_config(
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop: Sequence[str] | str | None = None,
    seed: int | None = None,
    stop_at: str = DEFAULT_STOP_AT,
    static: bool | None = None,
    draft_tokens: int | None = None,
) -> DecodeConfig:
    """A DecodeConfig from the keyword arguments users pass (`stop` may be one string)."""
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    return DecodeConfig(max_new_tokens, temperature, top_p, stops, seed, stop_at, static, draft_tokens)


@dataclass(frozen=True)
class AnswerOptions:
    """How to answer: the method (and its parameters), the recompute ratio, which stored KV to read,
    eviction after the first token, and the decode settings."""

    method: str | Method | None = None  # None: the engine's default (KVRag.default_method)
    recompute_ratio: float | str | AutoRatio = DEFAULT_RATIO  # "auto": see kvrag.methods.auto_ratio
    kv_kind: str = KIND_CHUNK
    evict: SnapKV | None = None
    method_params: Mapping[str, Any] = field(default_factory=dict)
    decode: DecodeConfig = field(default_factory=decode_config)
    min_recompute: int | None = None  # chunk tokens recomputed at least (all: Full Attention); None: the default
    short_context: int | None = None  # chunk tokens up to which the prompt is read with Full Attention; None: the default
    records_whole: bool | None = None  # chunks that are records of one kind read with Full Attention; None: the default
    prefix_cache: bool = True  # read a prompt's start from the exact prefix cache (an earlier turn) and keep this turn's KV there
    # the exact prefix cache's scope: a turn kept under one salt is read only by requests with the same salt
    # (a tenant of a shared server: kvrag.server.tenants); "": the unsalted scope, as every caller of one engine shares it
    cache_salt: str = ""
    # APE's temperature and scale on the question's and the answer's attention over reused chunk KV
    # (kvrag.model.ape); None or T = S = 1: ordinary attention. Full Attention and answers read whole ignore it.
    ape: Ape | None = None
    default_note: str = field(default="", compare=False)  # set where the method came from the engine's default: which, from where
    default_reason: str = field(default="", compare=False)  # ... and why (said once where asked: stats.default_reason)

    def __post_init__(self) -> None:
        for name in ("min_recompute", "short_context"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a whole number of tokens >= 0, got {value!r}")
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")
        if not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(self.cache_salt).__name__}")
        if self.records_whole is not None and not isinstance(self.records_whole, bool):
            raise ValueError(f"records_whole must be True, False or None, got {self.records_whole!r}")
        ratio = self.recompute_ratio
        if ratio == "auto":
            object.__setattr__(self, "recompute_ratio", AutoRatio())
        elif not isinstance(ratio, AutoRatio) and (
            isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0
        ):
            raise ValueError(f"recompute_ratio must be a number within [0, 1] or 'auto', got {ratio!r}")
        ape = Ape.of(self.ape)
        object.__setattr__(self, "ape", ape if ape is not None and ape.active else None)
        if self.kv_kind not in CHUNK_KINDS:
            raise ValueError(f"kv_kind must be one of {CHUNK_KINDS}, got {self.kv_kind!r}")

    @classmethod
    def from_kwargs(cls, base: "AnswerOptions | None" = None, **kwargs: Any) -> "AnswerOptions":
        """Options from the keyword arguments of `answer`/`stream`/`complete`: the known fields, decode
        settings, and anything else as the method's own parameters (`layer=2` for a3)."""
        base = base or cls()
        fields: dict[str, Any] = {}
        for name in OPTION_KEYS:
            if name in kwargs:
                fields[name] = kwargs.pop(name)
        if "options" in kwargs:
            raise TypeError("pass either options= or keyword options, not both")
        dec = {k: kwargs.pop(k) for k in DECODE_KEYS if k in kwargs}
        if dec:
            fields["decode"] = decode_config(**{**{k: getattr(base.decode, k) for k in DECODE_KEYS}, **dec})
        inherited = {} if "method" in fields else dict(base.method_params)  # another method: not the old one's parameters
        if "method" in fields:
            fields["default_note"] = fields["default_reason"] = ""  # a method named here is the caller's, not the default
        if kwargs or inherited != dict(base.method_params):
            fields["method_params"] = {**inherited, **kwargs}
        return dataclasses.replace(base, **fields)

    def min_recompute_tokens(self) -> int:
        """Chunk tokens every answer recomputes at least (Full Attention when the chunks hold no more):
        `min_recompute`, else $KVRAG_MIN_RECOMPUTE (a deployment's default), else DEFAULT_MIN_RECOMPUTE."""
        return _tokens_setting(self.min_recompute, "KVRAG_MIN_RECOMPUTE", DEFAULT_MIN_RECOMPUTE)

    def full_context_tokens(self) -> int:
        """Chunk tokens up to which every method reads the prompt whole with Full Attention: the larger
        of the short-context limit (`short_context`, $KVRAG_SHORT_CONTEXT, DEFAULT_SHORT_CONTEXT) and
        `min_recompute_tokens()` (recomputing at least all of them is Full Attention)."""
        short = _tokens_setting(self.short_context, "KVRAG_SHORT_CONTEXT", DEFAULT_SHORT_CONTEXT)
        return max(short, self.min_recompute_tokens())

    def records_read_whole(self) -> bool:
        """Whether chunks that are records of one kind are read whole: `records_whole`, else
        $KVRAG_RECORDS_WHOLE (a deployment's default: 1 or 0), else DEFAULT_RECORDS_WHOLE."""
        if self.records_whole is not None:
            return self.records_whole
        env = os.environ.get("KVRAG_RECORDS_WHOLE", "").strip().lower()
        if env in ("1", "true", "yes", "on"):
            return True
        if env in ("0", "false", "no", "off"):
            return False
        if env:
            raise ValueError(f"KVRAG_RECORDS_WHOLE must be 1 or 0, got {env!r}")
        return DEFAULT_RECORDS_WHOLE

    def whole_reason(self, chunks: Sequence[Chunk], context_tokens: int) -> str:
        """Why a request over these chunks (holding this many chunk tokens) is read whole with Full
        Attention by policy, or "" when it is not: its method is not Full Attention already, and the
        context is short (`full_context_tokens`, 0: off) or its chunks are records of one kind
        (`records_read_whole`; kvrag.methods.alike)."""
        if self.resolved_method().full_attention:
            return ""
        limit = self.full_context_tokens()
        if 0 < limit and context_tokens <= limit:
            rule = "min_recompute" if limit == self.min_recompute_tokens() else "short_context"
            return f"{context_tokens} chunk tokens <= {rule}={limit}: answered with Full Attention"
        if self.records_read_whole() and records_of_one_kind([f"{c.title}\n{c.text}" for c in chunks]):
            return "the chunks are records of one kind (records_whole): answered with Full Attention"
        return ""

    def whole_reason_for(self, resolved: "Resolved") -> str:
        """`whole_reason` for one request's resolved chunks, decided once and kept with them: the
        read-ahead, kvlink's routing and the pipeline all ask it."""
        if resolved.whole is None:
            resolved.whole = self.whole_reason(resolved.chunks, sum(len(ids) for ids in resolved.token_ids))
        return resolved.whole

    def prefix_signature(self, exact: bool) -> str | None:
        """How this request's KV is computed, as the exact prefix cache keys it (kvrag.kv.prefix_cache):
        "exact" for Full Attention (or a context read whole), else the method and every setting that
        shapes its KV; None when the request neither reads nor keeps prefixes (turned off, or SnapKV
        eviction, which leaves no full cache to keep). A `cache_salt` is part of it (hashed, never
        kept as given): entries are read only under the salt they were kept with."""
        if not self.prefix_cache or self.evict is not None:
            return None
        if exact:
            signature = "exact"
        else:
            method = self.method if isinstance(self.method, str) or self.method is None else repr(self.method)
            params = sorted((str(k), repr(v)) for k, v in dict(self.method_params).items())
            signature = repr((method, repr(self.recompute_ratio), self.kv_kind, params, self.min_recompute_tokens()))
            if self.ape is not None:
                signature += f"|{self.ape.tag}"
        return signature if not self.cache_salt else f"{signature}|salt={salt_digest(self.cache_salt)}"

    def with_default_method(self, method: str | DefaultSetting) -> "AnswerOptions":
        """These options, with `method` where they name none (what the engine does on every request). A
        `DefaultSetting` (a model's calibrated choice) also brings its ratio, unless these options name
        another ratio than DEFAULT_RATIO, and its note (`stats.default`)."""
        if self.method is not None:
            return self
        if not isinstance(method, DefaultSetting):
            return dataclasses.replace(self, method=method)
        ratio = self.recompute_ratio
        if not isinstance(ratio, AutoRatio) and ratio == DEFAULT_RATIO:
            ratio = method.ratio
        ape = self.ape if self.ape is not None else method.ape  # the caller's own APE setting wins
        return dataclasses.replace(self, method=method.method, recompute_ratio=ratio, ape=ape, default_note=method.label(),
                                   default_reason=method.why)

    def resolved_method(self) -> Method:
        """The method object; options that name none stand for DEFAULT_METHOD (an engine fills in its own first)."""
        return get_method(DEFAULT_METHOD if self.method is None else self.method, **dict(self.method_params))
