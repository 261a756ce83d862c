"""Plain data types shared by the engine, the CLI and the integrations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Chunk:
    """One retrievable piece of text. `id` is the user's handle (node id, document id, ...)."""

    id: str
    text: str
    title: str = ""
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def as_source(self, text: bool = False) -> dict[str, Any]:
        """What an answer read, as clients show it: id, title, the file it came from (metadata `source`,
        as `kvrag ingest` records it; "" if none), and with `text` the chunk's text."""
        out: dict[str, Any] = {"id": self.id, "title": self.title, "source": str(self.metadata.get("source", "") or "")}
        if text:
            out["text"] = self.text
        return out


@dataclass
class AnswerStats:
    """What one answer cost and which path it took; every answer carries these."""

    method: str = ""
    ttft_s: float = 0.0
    load_s: float = 0.0  # until the KV is usable: on the device (eager), or on the host ready to feed layers (layerwise)
    stitch_s: float = 0.0
    select_s: float = 0.0
    recompute_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_setup_s: float = 0.0  # inside decode_s: the static decoder's room and (CUDA) graph capture, once per answer
    prompt_tokens: int = 0
    context_tokens: int = 0
    question_tokens: int = 0
    recomputed_tokens: int = 0
    recompute_ratio: float = 0.0  # recomputed chunk tokens / chunk tokens held (what "auto" chose)
    whole_chunks: int = 0  # chunks recomputed whole besides the top tokens (records of one kind: kvrag.methods.alike)
    chunk_prefill_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    bytes_loaded: int = 0
    generated_tokens: int = 0
    kept_kv_ratio: float = 1.0
    kv_bytes: int = 0  # KV held by the decoding cache at its largest (end of decoding)
    path: str = ""
    tiers: dict[str, int] = field(default_factory=dict)  # chunks served per store tier ("disk": 3, "computed": 1)
    # SDPA kernel per pass kind, in query blocks: {"recompute": {"flash_attention": 1}, "probe": {...}}
    attention_kernels: dict[str, dict[str, int]] = field(default_factory=dict)
    # layer-wise loading (kvrag.fuse.layer_feed): the per-layer copy + rotate work, and the part of it the
    # passes waited for (inside select_s / recompute_s); layer_load_s - load_wait_s was hidden behind compute
    layerwise: bool = False
    layer_load_s: float = 0.0
    load_wait_s: float = 0.0
    weights: str = "base"  # "base", or "adapter": a weight-changing link adapter served this answer (kvlink's fast path)
    decode_weights: str = "model"  # what the decode steps read after the first token: "model" (its own weights) or "int8" (opt-in)
    decode_forwards: int = 0  # forwards after the first token; fewer than the tokens where drafts were right (kvrag.decode.draft)
    draft_accepted: int = 0  # tokens served from a drafted row the model agreed with, without a forward of their own
    full_reason: str = ""  # why a reuse method read the whole prompt with Full Attention (a short context, records of one kind), else ""
    echoed_header: str = ""  # chunk header line(s) the model recited before its answer, left out of it
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the exact prefix cache (a finished earlier turn): not read again
    turns: int = 1  # messages in the conversation answered (user and assistant; 1: a single question)
    default: str = ""  # where the request named no method: the default setting it got and from where ("full (calibrated)"), else ""
    default_reason: str = ""  # ... and why that setting is the default (the calibration's reason), said here, not in summary()
    ape: str = ""  # APE's setting where the question and answer attended with it ("ape(T=0.9,S=1)"), else ""

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AnswerStats":
        """Stats from their `as_dict()` form (a server's `kvrag_stats`, a message's metadata); keys it
        does not know (computed ones, or a newer server's) are left out."""
        from dataclasses import fields

        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    # A read-only dict view, so code written against the dict the integrations' metadata carries
    # (`stats["ttft_s"]`, `dict(stats)`) works on the object too: as_dict()'s keys, read from the object.
    def keys(self) -> list[str]:
        from dataclasses import fields

        return [f.name for f in fields(self)] + ["decode_tokens_per_s"]

    def __getitem__(self, name: str) -> Any:
        if name not in self.keys():
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self.keys() else default

    def reading(self) -> str:
        """How the answer read its context, in a line a person reads first ("fusionrag recomputed 15%
        (84 of 560 chunk tokens)", "read whole: 560 chunk tokens <= short_context=768", ...)."""
        if self.path == "plain":
            how = "plain chat (no chunks)"
        elif self.full_reason:
            how = "read whole: " + self.full_reason.split(": answered with Full Attention")[0]
        elif self.method == "full":
            how = f"full: read whole ({self.context_tokens} chunk tokens)"
        else:
            how = (f"{self.method}{'+' + self.ape if self.ape else ''} recomputed {self.recomputed_tokens / max(1, self.context_tokens):.0%} "
                   f"({self.recomputed_tokens} of {self.context_tokens} chunk tokens)")
        if self.prefix_hit_tokens:
            how += f"; {self.prefix_hit_tokens} of {self.prompt_tokens} prompt tokens from the previous turn"
        return f"{how} | chunk KV hits {self.cache_hits}, misses {self.cache_misses} | TTFT {self.ttft_s * 1000:.0f} ms"

    def summary(self) -> str:
        """The stats in one line of name=value; a context read whole by policy says so first
        (`read_whole="560 chunk tokens <= short_context=768"`), as `reading()` and the CLI do, so
        `hits=0 misses=0` is never left to explain itself."""
        whole = self.full_reason.split(": answered with Full Attention")[0] if self.full_reason else ""
        return (
            f"method={self.method} " + (f"ape={self.ape} " if self.ape else "") + (f'read_whole="{whole}" ' if whole else "")
            + f"ttft={self.ttft_s * 1000:.0f}ms prompt={self.prompt_tokens} "
            f"recomputed={self.recomputed_tokens} chunk_prefill={self.chunk_prefill_tokens} "
            f"hits={self.cache_hits} misses={self.cache_misses} loaded={self.bytes_loaded / 1e6:.1f}MB "
            f"kept={self.kept_kv_ratio:.2f} kv={self.kv_bytes / 1e6:.1f}MB decode={self.decode_tokens_per_s:.1f}tok/s"
            + (f" drafts_served={self.draft_accepted}" if self.draft_accepted else "")
            + (f" whole_chunks={self.whole_chunks}" if self.whole_chunks else "")
            + (f" prefix_hit={self.prefix_hit_tokens}" if self.prefix_hit_tokens else "")
            + (" tiers=" + ",".join(f"{t}:{n}" for t, n in sorted(self.tiers.items())) if self.tiers else "")
            + (f" default={self.default.split(' ')[0]}" if self.default else "")
        )


@dataclass
class Answer:
    text: str
    stats: AnswerStats
    chunk_ids: list[str] = field(default_factory=list)
