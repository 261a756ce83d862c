"""Greedy or sampled decoding from a prefilled cache, streaming text pieces, with stop strings.

Each token's forward is one of two steppers with the same call, `(token, position) -> logits`:
`EagerStep` appends to the growing cache (the CPU default), `StaticDecoder` (kvrag.decode.static)
writes into a fixed-capacity buffer with a fixed-shape step that a CUDA graph replays (the CUDA
default, `DecodeConfig.static`). Token choice, stop rules and detokenisation are shared, so the two
pick the same tokens from the same logits. The static step may feed tokens drafted from the prompt
with each forward (kvrag.decode.draft, `DecodeConfig.draft_tokens`) and serve the next steps from
their rows: fewer forwards, the same tokens.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, Sequence

import numpy as np
import torch

from kvrag.model.cache import cache_arg
from kvrag.model.home_thread import on_home
from kvrag.model.loading import LoadedModel
from kvrag.decode.lean import lean_supported
from kvrag.decode.static import StaticDecoder, supports
from kvrag.model.ape import DecodeApe, decoding_with
from kvrag.defaults import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS


@dataclass
class DecodeConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop: Sequence[str] = ()
    seed: int | None = None
    stop_at: str = "none"  # "sentence": end after the first complete sentence; "line": at the first line break
    static: bool | None = None  # static KV buffer + fixed-shape step (a CUDA graph on CUDA); None: auto (static_on)
    draft_tokens: int | None = None  # prompt-lookup drafts verified with each step (kvrag.decode.draft); 0: none; None: auto (drafts_for)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.stop_at not in STOP_RULES:
            raise ValueError(f"stop_at must be one of {sorted(STOP_RULES)}, got {self.stop_at!r}")
        d = self.draft_tokens
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_DRAFT_TOKENS):
            raise ValueError(f"draft_tokens must be an integer within [0, {MAX_DRAFT_TOKENS}] or None (auto), got {d!r}")
        if self.static is not None and not isinstance(self.static, bool):
            raise ValueError(f"static must be True, False or None (auto: on for CUDA), got {self.static!r}")

    def drafts_for(self, dtype: torch.dtype) -> int:
        """Drafted tokens a step feeds (auto: DEFAULT_DRAFT_TOKENS for float32 weights, none otherwise:
        in bfloat16 a three-row step's rounding differs enough from a one-row step's to change 12 of
        the sample's 36 answers at 64 tokens, where float32 changed none)."""
        if self.draft_tokens is not None:
            return self.draft_tokens
        return DEFAULT_DRAFT_TOKENS if dtype == torch.float32 else 0

    def static_on(self, device: torch.device, model: Any = None) -> bool:
        """Whether to decode with the static step (auto: on CUDA, where a graph replays it, and wherever
        the lean step reproduces `model` exactly: 5-10% more tokens/s on the CPU, more with context)."""
        if self.static is not None:
            return self.static
        return device.type == "cuda" or (model is not None and lean_supported(model))


_SENTENCE_END = re.compile(r"(?<!\b[A-Z])[.!?][\"')\]]*(?=\s)")
from kvrag.defaults import STOP_RULES  # noqa: E402,F401


def rule_cut(text: str, rule: str) -> int:
    """Where a short answer is complete under `rule` (-1: not yet). "line": at the first line break
    after some text; "sentence": after the first sentence's end mark once whitespace follows it (so
    "3.14" or "e.g" mid-word never end one), or at a line break."""
    if rule == "none":
        return -1
    start = len(text) - len(text.lstrip())
    nl = text.find("\n", start)
    cut = nl if nl > start else -1
    if rule == "sentence":
        m = _SENTENCE_END.search(text, start)
        if m is not None and (cut < 0 or m.end() < cut):
            cut = m.end()
    return cut

def leading_echo(text: str, start: int, headers: Collection[str]) -> tuple[int, int | None]:
    """Skip the complete lines at the head of text[start:] that only repeat one of the prompt's
    chunk headers (`headers`, e.g. "Document: eiffel"): a reused cache sometimes makes a model
    recite a header before it answers, and a header is never the answer (nor its first line, for
    the stop rules). Returns where the answer starts now and, while its first line is unfinished
    and could still become such a header, where that line begins (hold it back), else None."""
    while headers:
        at = len(text) - len(text[start:].lstrip())
        nl = text.find("\n", at)
        line = text[at : nl if nl >= 0 else len(text)].strip()
        if nl < 0:
            return start, (at if any(h.startswith(line) for h in headers) else None)
        if line not in headers:
            break
        start = nl + 1
    return start, None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def eos_ids(lm: LoadedModel) -> set[int]:
    """End-of-turn ids: the tokenizer's eos plus the generation config's (chat models often differ)."""
    ids: set[int] = set()
    for src in (getattr(lm.model, "generation_config", None), lm.tokenizer):
        val = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(val, int):
            ids.add(val)
        elif isinstance(val, (list, tuple)):
            ids.update(int(v) for v in val)
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>"):
        tid = lm.tokenizer.convert_tokens_to_ids(tok) if hasattr(lm.tokenizer, "convert_tokens_to_ids") else None
        unk = getattr(lm.tokenizer, "unk_token_id", None)
        if isinstance(tid, int) and tid != unk and tid >= 0:
            ids.add(tid)
    return ids


def pick_token(logits: torch.Tensor, cfg: DecodeConfig, gen: torch.Generator | None) -> int:
    if cfg.temperature == 0:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:  # numpy: no torch threads in this thread
            return int(np.argmax(logits.numpy()))  # the first of equal maxima (or the first NaN), as torch.argmax
        return int(torch.argmax(logits))
    return on_home(_sample, logits, cfg, gen)


def _sample(logits: torch.Tensor, cfg: DecodeConfig, gen: torch.Generator | None) -> int:
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < cfg.top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


class IncrementalText:
    """The text of a growing token list, decoded a few tokens at a time instead of all of it per step.

    Each step decodes only the tokens since the last emitted piece, with the piece before them as
    context (so tokenizers that merge spaces across tokens decode as they would in full), and holds
    the text back while it ends in an incomplete character.
    """

    MAX_CHAR_TOKENS = 4  # a UTF-8 character spans at most 4 bytes, so at most 4 byte-level tokens

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append a token; returns the text it completed (possibly empty)."""
        self.ids.append(token)
        new_text = self._decode(self.ids[self._prefix_offset :])
        # an incomplete character at the end: wait, but no longer than a character's bytes can take
        # (a model that emits invalid bytes would otherwise never stream)
        waiting = new_text.endswith("\ufffd") and len(self.ids) - self._read_offset < self.MAX_CHAR_TOKENS
        if waiting or len(new_text) <= len(self._prefix_text):
            return ""
        if not new_text.startswith(self._prefix_text):
            return self._resync()
        piece = new_text[len(self._prefix_text) :]
        self.text += piece
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        return piece

    def _resync(self) -> str:
        """Rare: the context decoded differently once more tokens came; fall back to a full decode."""
        full = self._decode(self.ids)
        piece = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += piece
        self._prefix_offset = self._read_offset = len(self.ids)
        self._prefix_text = ""
        return piece

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end), as a full decode would give it."""
        full = self._decode(self.ids)
        piece = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += piece
        return piece


@dataclass
class DecodeState:
    """Filled in while decoding so callers can read counts after the stream ends."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    echoed: str = ""  # leading lines that only repeated a chunk header, left out of the answer
    setup_s: float = 0.0  # the static decoder's one-time set-up (room, graph capture), inside the decode time
    weights: str = "model"  # what the decode steps read: the model's own weights, or "int8" (kvrag.decode.int8)
    forwards: int = 0  # forwards after the first token (the prefill gave it)
    accepted: int = 0  # tokens whose forward had run already, as a verified draft (kvrag.decode.draft)


class EagerStep:
    """The growing-cache forward: the new token's K/V appended to `cache` (a SpliceCache writes into its room)."""

    setup_s = 0.0  # nothing to set up: the cache grows as it goes
    weights = "model"  # the stock forward: the model's own weights
    accepted = 0  # no drafts: a forward a token

    def __init__(self, lm: LoadedModel, cache: Any, ape: DecodeApe | None = None) -> None:
        self.lm, self.cache = lm, cache
        self.forwards = 0
        self.ape = ape  # APE over the chunk slots (kvrag.model.ape), applied by the model's attention

    @torch.no_grad()
    def __call__(self, token: int, position: int) -> torch.Tensor:
        self.forwards += 1
        return on_home(self._locked, token, position)

    def _locked(self, token: int, position: int) -> torch.Tensor:
        with self.lm.lock:
            return self._forward(token, position)

    def _forward(self, token: int, position: int) -> torch.Tensor:
        with decoding_with(self.ape):
            return self._model_forward(token, position)

    def _model_forward(self, token: int, position: int) -> torch.Tensor:
        out = self.lm.model(
            input_ids=torch.tensor([[token]], device=self.lm.device),
            position_ids=torch.tensor([[position]], device=self.lm.device),
            **cache_arg(self.lm.model, self.cache),
            use_cache=True,
        )
        return out.logits[0, -1]

    def close(self) -> None:
        """Nothing to hand back: the cache grew as it went."""


Stepper = EagerStep | StaticDecoder


def stepper(lm: LoadedModel, cache: Any, next_position: int, cfg: DecodeConfig, max_position: int | None = None,
            context_ids: Sequence[int] = (), ape: DecodeApe | None = None) -> Stepper:
    """The forward each decoded token takes: static (CUDA graph on CUDA) when `cfg` asks for it and the
    cache allows it (see `kvrag.decode.static.supports`), else eager. Sized for the forwards this
    decode can still take: one fewer than max_new_tokens (the first token comes from the prefill),
    and none at or past `max_position`. The static step drafts from `context_ids` (the prompt's tokens)."""
    if cfg.static_on(lm.device, lm.model) and supports(cache):
        steps = cfg.max_new_tokens - 1
        if max_position is not None:
            steps = min(steps, max_position - next_position)
        return StaticDecoder(lm, cache, max(steps, 1), context_ids=context_ids, draft_tokens=cfg.drafts_for(lm.dtype), ape=ape)
    return EagerStep(lm, cache, ape)


@torch.no_grad()
def stream_tokens(
    lm: LoadedModel,
    cache: Any,
    first_logits: torch.Tensor,
    next_position: int,
    cfg: DecodeConfig,
    state: DecodeState,
    max_position: int | None = None,
    headers: Collection[str] = (),
    context_ids: Sequence[int] = (),
    ape: DecodeApe | None = None,
) -> Iterator[str]:
    """Yield text pieces as tokens are generated; stops at eos, a stop string or max_new_tokens.
    Leading lines that only repeat one of `headers` (the prompt's chunk headers) are left out.
    `context_ids`: the prompt's tokens, which drafts are looked up in (`DecodeConfig.draft_tokens`).
    `ape`: every step attends over the chunk slots as APE does (kvrag.model.ape)."""
    forward = LazyStep(lambda: stepper(lm, cache, next_position, cfg, max_position, context_ids, ape))
    try:
        yield from _stream(lm, forward, first_logits, next_position, cfg, state, max_position, headers)
    finally:  # also when the stream is abandoned: the cache reads as decoded so far
        forward.close()
        step = forward.step
        if step is not None:  # else no forward ran: the state's defaults hold
            state.setup_s, state.weights = step.setup_s, step.weights
            state.forwards, state.accepted = step.forwards, step.accepted


class LazyStep:
    """A stepper made at the first forward (an answer that ends at its first token needs none)."""

    def __init__(self, make: Callable[[], Stepper]) -> None:
        self._make = make
        self.step: Stepper | None = None

    def __call__(self, token: int, position: int) -> torch.Tensor:
        if self.step is None:
            self.step = on_home(self._make)
        return self.step(token, position)

    def close(self) -> None:
        if self.step is not None:
            on_home(self.step.close)


def _stream(
    lm: LoadedModel,
    forward: LazyStep,
    first_logits: torch.Tensor,
    next_position: int,
    cfg: DecodeConfig,
    state: DecodeState,
    max_position: int | None,
    headers: Collection[str] = (),
) -> Iterator[str]:
    """The decode loop itself; `forward` is the only part that differs between eager and static.
    The answer is text[start:]: what follows any leading header echo (never emitted)."""
    tok = lm.tokenizer
    stops = [s for s in cfg.stop if s]
    hold = max((len(s) for s in stops), default=1) - 1
    eos = eos_ids(lm)
    gen = None
    if cfg.seed is not None:
        gen = torch.Generator(device=first_logits.device).manual_seed(cfg.seed)
    logits = first_logits
    emitted = start = 0
    settled = not headers
    detok = IncrementalText(tok)
    pos = next_position
    for step in range(cfg.max_new_tokens):
        token = pick_token(logits, cfg, gen)
        if token in eos:
            state.finish_reason = "eos"
            break
        state.token_ids.append(token)
        detok.add(token)
        text = detok.text
        held = None
        if not settled:  # once the first line is a non-header, the head never changes: skip the scan
            start, held = leading_echo(text, start, headers)
            emitted = max(emitted, start)
            settled = held is None and bool(text[start:].strip())
        cut = _answer_cut(text, start, stops, cfg.stop_at)
        if cut >= 0:
            if cut > emitted:
                yield text[emitted:cut]
            state.finish_reason = "stop"
            state.echoed = text[:start]
            return
        safe = len(text) - hold if held is None else min(len(text) - hold, held)
        if safe > emitted:
            yield text[emitted:safe]
            emitted = safe
        if step + 1 == cfg.max_new_tokens or (max_position is not None and pos >= max_position):
            state.finish_reason = "length"
            break
        logits = forward(token, pos)
        pos += 1
    else:
        state.finish_reason = state.finish_reason or "length"
    detok.flush()
    text = detok.text
    start, _ = leading_echo(text, start, headers)  # an unfinished header-like line at the end is kept
    emitted = max(emitted, start)
    state.echoed = text[:start]
    cut = _answer_cut(text, start, stops, "none")
    if cut >= 0:
        text = text[:cut]
        state.finish_reason = "stop"
    if len(text) > emitted:
        yield text[emitted:]


def _answer_cut(text: str, start: int, stops: Sequence[str], rule: str) -> int:
    """Where the answer text[start:] ends: the first stop string or the stop rule's cut (-1: not yet)."""
    answer = text[start:]
    cut = min((answer.find(s) for s in stops if s in answer), default=-1)
    done = rule_cut(answer, rule)
    if done >= 0 and (cut < 0 or done < cut):
        cut = done
    return cut + start if cut >= 0 else -1
