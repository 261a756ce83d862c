"""The words and defaults that a request, the command line and the server share.

Nothing here imports torch, so `kvrag --help` and `kvrag ask --server URL` start at once; the modules
that act on these values (options, decode, links, training, the disk store) import them from here.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# A request that names no method gets the setting its model's calibration chose (kvrag.check.calibrate:
# the fastest setting that gives Full Attention's answer on the calibration set, else Full). Where
# calibration is off ($KVRAG_CALIBRATE=0, `calibrate=False`), this fixed fast setting, as `kvrag eval suite`'s rule picks it
# (docs/bench/suite; docs/methods.md, how the default is chosen): with the six-long-document fact set at 30
# questions, cacheblend@0.15 and fusionrag@0.15 keep up with base Full on the same 12 of 14 blocks
# (both lose there: 5 and 6 of 30 against Full's 10 at 16 tokens), and fusionrag agrees with base
# Full's answer more often (mean 0.649 against 0.601), as on the 400 held-out NQ questions (0.265
# against 0.223, docs/bench/nq10-400) and in MEASURED.md (0.175 against 0.075), at 4.7x Full's TTFT
# on the 10-passage sets (cacheblend 4.6x). Its cost: ~37% more peak GPU memory at 32k (MEASURED.md).
# A model served with a tuned link adapter answers with "kvlink" instead
# (`KVRag.default_method`): options leave the method None and the engine fills it in.
DEFAULT_METHOD = "fusionrag"
TUNED_METHOD = "kvlink"
RATIO_FREE = ("full", "reuse", TUNED_METHOD)  # methods that, as named, recompute no chosen share of chunk tokens
DEFAULT_RATIO = 0.15


@dataclass(frozen=True)
class Ape:
    """APE's attention change (Yang, Chen, Chen, ICLR 2025) for reused chunk KV: the question's and the
    answer's attention over the chunk tokens takes scores divided by `temperature` (T), and that part's
    weight against the rest (the system prefix, the question, the answer so far) is softmax([S*T*L_C, L_N])
    with L the log-sum-exp of each part's scores and S the `scale`. T = S = 1 is ordinary attention.
    Chosen per model by calibration (kvrag.check.calibrate), never on the data that judges it."""

    temperature: float = 1.0
    scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.05 <= float(v) <= 4.0):
                raise ValueError(f"ape {name} must be a number within [0.05, 4], got {v!r}")
            object.__setattr__(self, name, float(v))

    @property
    def active(self) -> bool:
        """Whether it changes anything (T = S = 1 is ordinary attention: the stock path runs)."""
        return self.temperature != 1.0 or self.scale != 1.0

    @property
    def tag(self) -> str:
        return f"ape(T={self.temperature:g},S={self.scale:g})"

    @classmethod
    def of(cls, value: Any) -> "Ape | None":
        """An Ape from what users pass: None, an Ape, (T, S), {"temperature": T, "scale": S} or "T,S"."""
        if value is None or isinstance(value, Ape):
            return value
        if isinstance(value, str):
            value = [p for p in value.replace(" ", "").split(",") if p]
            try:
                value = [float(p) for p in value]
            except ValueError:
                raise ValueError(f"ape must be 'T,S' (two numbers), got {value!r}") from None
        if isinstance(value, dict):
            unknown = set(value) - {"temperature", "scale"}
            if unknown:
                raise ValueError(f"ape takes temperature and scale, not {sorted(unknown)}")
            return cls(**value)
        if isinstance(value, (list, tuple)) and len(value) == 2:
            return cls(*value)
        raise ValueError(f"ape must be (temperature, scale), a dict of them or 'T,S', got {value!r}")


@dataclass(frozen=True)
class DefaultSetting:
    """What a request that names no method gets, and why: over base weights, the setting the model's
    calibration chose (kvrag.check.calibrate), else the fixed DEFAULT_METHOD at DEFAULT_RATIO."""

    method: str
    ratio: float = DEFAULT_RATIO
    source: str = "fixed"  # "calibrated", "fixed" (calibration off) or "adapter" (a tuned link adapter was asked for)
    why: str = ""
    ape: Ape | None = None  # APE's temperature and scale on the question's and answer's attention (None: off)

    @property
    def name(self) -> str:
        return setting_name(self.method, self.ratio, self.ape)

    def label(self) -> str:
        """The setting and where it came from, short ("fusionrag@0.5 (calibrated)"): what every answer's stats say."""
        return f"{self.name} ({self.source})"

    def note(self) -> str:
        """One line: the setting and why (what `stats.default`, `kvrag methods` and /health say)."""
        return f"{self.name} ({self.source}: {self.why})" if self.why else f"{self.name} ({self.source})"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "name": self.name}


def setting_name(method: str, ratio: float, ape: Ape | None = None) -> str:
    """How a setting is named everywhere (calibration rows, `kvrag methods`, stats): "fusionrag@0.15",
    "reuse", "reuse+ape(T=0.9,S=1)"."""
    name = method if method in RATIO_FREE else f"{method}@{ratio:g}"
    return f"{name}+{ape.tag}" if ape is not None and ape.active else name


FIXED_DEFAULT = DefaultSetting(DEFAULT_METHOD, DEFAULT_RATIO, "fixed", "calibration off")

# Every answer recomputes at least this many chunk tokens, and reads chunks that hold no more than this
# with Full Attention over the base weights. Recomputing a fixed number of tokens costs a fixed, small
# time (~0.1 s on a 2-core CPU), while r = 0.15 of a short context is a handful of tokens: on
# one-sentence documents reuse at r = 0.15 lost 4 of the 9 facts Full got (MEASURED.md). At 10 passages
# (~1,250 tokens) r = 0.15 already recomputes more, so long prompts keep their speed. `stats.full_reason`
# and `stats.recompute_ratio` say what was done; 0 turns it off.
DEFAULT_MIN_RECOMPUTE = 160
# A context of at most this many chunk tokens is read whole, with Full Attention, by every method: it is
# cheap to read (~1 s on a 2-core CPU, milliseconds on a GPU) and reuse saves little there, while on the
# bundled sample (top-5 retrieval, ~570-650 tokens) cacheblend@0.15 lost 8 of the 21 phrasings base Full
# answered right (4 still at min_recompute 320). 10-passage prompts (~950-1,550 tokens) stay fast.
# `stats.full_reason` says when it applied; 0 turns it off.
DEFAULT_SHORT_CONTEXT = 768
# Chunks that are records of one kind (kvrag.methods.alike: the same phrasing with other names and values,
# "The length of the X River is ... km" six times over) are read whole, with Full Attention, by every
# method: there reused chunks cannot tell the records apart and answer with another record's value. On
# 120 answers over fresh six- and eight-record questions base Full contained the answer in 33, fusionrag
# @0.15 in 22, and recomputing the named record whole as well (whole_chunks=1) in 27 (docs/bench/records).
# Natural passages (NQ, MuSiQue, the sample) never tripped the test. `stats.full_reason` says when it
# applied; False turns it off.
DEFAULT_RECORDS_WHOLE = True
# Calibration per model (kvrag.check.calibrate): a setting is the default only if it gives Full Attention's
# answer on at least this share of the calibration questions, and its median TTFT beats Full's by this factor.
CALIBRATION_BUDGET = 0.9
CALIBRATION_MIN_SPEEDUP = 1.2
# ... and, where Full Attention answers enough calibration questions right to rule on (kvrag.check.calibration_rule),
# a setting must answer right at least this share of the questions Full answers right, and trail Full's right count
# by at most one in CALIBRATION_SLACK_PER questions: what a user loses is a right answer, not a reworded one.
CALIBRATION_KEEP = 0.9
CALIBRATION_SLACK_PER = 30
# Short-answer RAG: the answer is complete after its first sentence (the model would ramble on).
DEFAULT_STOP_AT = "sentence"
# The precision the default disk store keeps KV at (an explicit `disk://` URL keeps what it says, exact
# without `quantize=`), chosen by `kvrag eval storage`'s rule (docs/bench/storage): bf16 gave float32
# storage's answers on every set (144 of 144); int8 did not (one-sentence facts 10/12, MuSiQue 5/6).
DEFAULT_DISK_PRECISION = "bf16"

STOP_RULES = ("none", "line", "sentence")  # when an answer is complete (kvrag.decode.stream)
# Prompt-lookup drafts fed with each CPU decode step (kvrag.decode.draft) of a float32 model: the answer
# stays the model's own, token for token. Measured on the bundled model (1.3k context, 2 cores): a forward
# over 1, 3 and 5 rows took 58, 66 and 92 ms; with 2 drafts the sample's questions decoded 1.4x faster,
# with 3 only 1.2x. Not by default in bfloat16/float16 (DecodeConfig.drafts_for): there a three-row
# step's rounding changed 12 of the sample's 36 answers (64 tokens), so drafts are opt-in there.
DEFAULT_DRAFT_TOKENS = 2
MAX_DRAFT_TOKENS = 8

# the `link_adapter=` / `--link-adapter` words that name shipped adapters (kvrag.fuse.links)
SHIPPED_SPECS = ("auto", "links", "tuned")
DEFAULT_MAX_CHUNKS = 10  # chunk indices with their own link rows (KVLink's reference code: 10)
# what KVLink training changes: link rows; trailer rows (link slots that see only the prefix and their own chunk, as
# KV Packet's trailer vectors do); + LoRA; + LoRA applied only after the cached chunks (the chunks' KV stays the base
# weights', one store for every method); + every weight
LINK_MODES = ("links", "trailers", "lora", "lora-after", "full")
LORA_MODES = ("lora", "lora-after")
BASE_CHUNK_MODES = ("links", "trailers", "lora-after")  # the adapter reads the base weights' chunk KV
WEIGHTS_KEPT_MODES = ("links", "trailers")  # only link rows are trained: the model's weights stay as they are
CHUNK_SCOPED_MODES = ("trailers",)  # each chunk's link slots see the prefix and their own chunk only


def link_scope(mode: str | None) -> str:
    """What an adapter's link slots attend to: "chunk" (trailers: the prefix and their own chunk) or "global" (KVLink's
    links: every earlier position). None (no adapter) is "global"."""
    return "chunk" if mode in CHUNK_SCOPED_MODES else "global"
OBJECTIVES = ("gold", "distill")  # KVLink training's loss: gold answers, or distillation from base Full Attention


def names_no_adapter(spec: object) -> bool:
    """Whether `link_adapter=spec` asks for the base weights: None, or "none" in any case (the
    command line's spelling, so the API and `--link-adapter none` read the same word alike)."""
    return spec is None or (isinstance(spec, str) and spec.lower() == "none")


DECODE_WEIGHTS = ("model", "int8")  # what decode steps read: the model's own weights (default), or int8 (kvrag.decode.int8)
LAYERWISE_CHOICES = ("auto", "on", "off", "both")  # `kvrag bench speed --layerwise`
STALE_TEMP_S = 3600.0  # a disk writer's temp file older than this is abandoned (`kvrag store gc`)


def kvrag_home() -> Path:
    """Where kvrag keeps everything it writes ($KVRAG_HOME, default ~/.kvrag)."""
    return Path(os.environ.get("KVRAG_HOME", Path.home() / ".kvrag")).expanduser()


def model_cache_dir() -> Path:
    """Where converted model weights are kept, once per source file for every $KVRAG_HOME of this user:
    $KVRAG_MODEL_CACHE, default $XDG_CACHE_HOME/kvrag/models (~/.cache/kvrag/models). A second home
    then costs no second de-quantisation and no second copy of the weights."""
    explicit = os.environ.get("KVRAG_MODEL_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kvrag" / "models"
