"""`kvrag ask`, `kvrag quickstart`, `kvrag methods`: answer from the ingested chunks, compare with Full Attention."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvrag.kv.prefix_cache import without_prefix_cache
from kvrag.cli import common
from kvrag.types import Chunk
from kvrag.cli.args import draft_count, positive_int, ratio_or_auto
from kvrag.cli.common import DEFAULT_K, add_engine_options, add_server_option
from kvrag.defaults import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_METHOD,
    DEFAULT_MIN_RECOMPUTE,
    DEFAULT_RATIO,
    DEFAULT_SHORT_CONTEXT,
    DEFAULT_STOP_AT,
    RATIO_FREE,
    STOP_RULES,
    TUNED_METHOD,
)
from kvrag.errors import KVRagError
from kvrag.ingest.samples import sample_corpus_dir, sample_questions


def register(sub: argparse._SubParsersAction) -> None:
    ask = sub.add_parser("ask", help="answer a question from the ingested chunks")
    add_engine_options(ask)
    add_server_option(ask)
    ask.add_argument("question", help="the question, in quotes")
    ask.add_argument("--method", default=None,
                     help=f"full, reuse, ... (see `kvrag methods`; default: the setting this model's calibration chose, "
                          f"{DEFAULT_METHOD} where calibration is off, or {TUNED_METHOD} with --link-adapter tuned)")
    ask.add_argument("--recompute-ratio", type=ratio_or_auto, default=DEFAULT_RATIO, help=f"share of chunk tokens recomputed, or 'auto' (default {DEFAULT_RATIO})")
    ask.add_argument("--ape", type=_ape_arg, default=None, metavar="T,S",
                     help="APE's temperature and scale on the question's and answer's attention over reused chunk KV "
                          "(e.g. 0.9,1; default: none, or as the calibrated default has it; docs: Methods)")
    ask.add_argument("--min-recompute", type=int, default=None, metavar="TOKENS",
                     help=f"chunk tokens recomputed at least; chunks holding no more are read with Full Attention (0: off; default {DEFAULT_MIN_RECOMPUTE})")
    ask.add_argument("--short-context", type=int, default=None, metavar="TOKENS",
                     help=f"contexts of at most this many chunk tokens are read with Full Attention by every method (0: off; default {DEFAULT_SHORT_CONTEXT})")
    ask.add_argument("--records-whole", choices=("on", "off"), default=None,
                     help="chunks that are records of one kind (one phrasing, other names and values) are read with Full "
                          "Attention by every method (default: on, or $KVRAG_RECORDS_WHOLE)")
    ask.add_argument("--stop-at", choices=STOP_RULES, default=None,
                     help=f"end the answer after its first sentence or line (default {DEFAULT_STOP_AT}; with --server: the server's)")
    ask.add_argument("-k", "--top-k", type=positive_int, default=DEFAULT_K, help=f"chunks to retrieve (default {DEFAULT_K})")
    ask.add_argument("--max-new-tokens", type=int, default=64, help="the most tokens the answer may have")
    ask.add_argument("--draft-tokens", type=draft_count, default=None, metavar="N",
                     help="tokens drafted from the prompt and checked with each decode step (fewer steps; 0: none; "
                          f"default {DEFAULT_DRAFT_TOKENS} for float32 models, where answers stay the same, else 0)")
    ask.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the same answer every time); above 0: sampled")
    ask.add_argument("--json", action="store_true", help="print answer, sources and stats as one JSON object")
    ask.add_argument("--compare", action="store_true",
                     help="also answer with Full Attention (the reference) and print the speed-up and whether the answers "
                          "agree (each setting runs once untimed first)")
    ask.add_argument("--sources", action="store_true", help="after the answer, list the chunks it read: title, file, id, first line")
    ask.add_argument("--param", action="append", default=[], metavar="K=V", help="a method parameter, e.g. update=fusion")
    ask.add_argument("--evict-budget", type=int, default=None, help="SnapKV: chunk tokens kept per layer/head after the first token")

    qs = sub.add_parser("quickstart", help="ingest the sample corpus and compare Full Attention with KV reuse")
    add_engine_options(qs)
    qs.add_argument("--follow-up", default=None,
                    help=f"a follow-up to --question, asked in the same conversation (default: {FOLLOW_UP!r} after the "
                         "sample's first question; none after your own unless given)")
    qs.add_argument("--question", default=None,
                    help="your own question about the sample corpus, asked over the retrieved chunks (default: the sample's first)")

    me = sub.add_parser("methods", help="list the available methods, and the default this model's calibration chose")
    me.add_argument("--model", default=os.environ.get("KVRAG_MODEL"),
                    help="whose calibrated default to show: HF model id, folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    ask.set_defaults(func=cmd_ask)
    qs.set_defaults(func=cmd_quickstart)
    sub.choices["methods"].set_defaults(func=cmd_methods)


def _ape_arg(text: str):
    """`--ape T,S` as an Ape (argparse reports the ValueError's message)."""
    from kvrag.defaults import Ape

    try:
        return Ape.of(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_ask(args: argparse.Namespace) -> int:
    if args.method is not None:
        check_method(args.method, method_params(args))  # a mistyped method or parameter: an error before anything loads
    if not args.server:  # (through a server, its own index may answer: see _ask_via_server)
        common.require_index(args)  # nothing ingested: an error before torch or a model loads (within a second)
    params = method_params(args)
    if args.server:
        return _ask_via_server(args, dict(params))  # no method named: the server's, which checks the parameters
    from kvrag.methods.snapkv import SnapKV

    rag, index = common.open_engine(args)
    if args.method is None:
        check_method(rag.default_method, params)  # the parameters belong to the engine's default method
    chunks = common.retrieve(index, args.question, args.top_k)
    options = dict(
        recompute_ratio=args.recompute_ratio,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        stop_at=args.stop_at or DEFAULT_STOP_AT,
        draft_tokens=args.draft_tokens,
        **read_whole_flags(args),
        evict=SnapKV(budget=args.evict_budget) if args.evict_budget is not None else None,
        **({"ape": args.ape} if getattr(args, "ape", None) is not None else {}),
        **dict(params),
    )
    if args.compare:
        return _ask_compared(args, rag, chunks, options)
    stream = rag.stream(args.question, chunks=chunks, method=args.method, **options)
    if args.json:
        ans = stream.answer()
        print(json.dumps({"answer": ans.text, "chunk_ids": ans.chunk_ids, "sources": sources(chunks), "stats": ans.stats.as_dict()}))
        return 0
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.sources:
        print(source_lines(chunks))
    print(stream.stats.reading(), file=sys.stderr)
    print(stream.stats.summary(), file=sys.stderr)
    return 0


def _ask_compared(args: argparse.Namespace, rag, chunks, options: dict) -> int:
    """`ask --compare`: the answer, then Full Attention's beside it with the speed-up and the agreement."""
    if args.temperature > 0:
        raise KVRagError("--compare needs greedy answers (--temperature 0): sampled answers differ run to run")
    method = args.method  # None: the default setting, with its calibrated ratio and APE
    runs = [(method, {}, "")] if (method or rag.default_method) == "full" else [(method, {}, ""), ("full", {}, "")]
    rows = compare_runs(rag, args.question, chunks, runs, **options)
    mine, full = rows[0], rows[-1]
    from kvrag.cli.compare_text import compare_json, compare_line

    if args.json:
        print(json.dumps({"answer": mine.text, "chunk_ids": [c.id for c in chunks], "sources": sources(chunks),
                          "compare": [compare_json(r) for r in rows]}))
        return 0
    print(mine.text)
    if args.sources:
        print(source_lines(chunks))
    if mine.agrees is None:
        print("(--compare: this answer is Full Attention's, the reference)")
    else:  # never "sooner" for a slower answer, nor a ratio where both read the same tokens whole
        print(compare_line(mine, full))
    print(mine.reading, file=sys.stderr)
    return 0


def method_params(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """--param K=V ... as (name, value) pairs, values parsed as numbers where they are."""
    from kvrag.eval.runner import parse_method

    return parse_method("m:" + ",".join(args.param))[1]


def check_method(method: str, params: Sequence[tuple[str, Any]]) -> None:
    """A mistyped method or parameter as a one-line error, not a traceback."""
    from kvrag.methods import get_method

    try:
        get_method(method, **dict(params))
    except TypeError as exc:
        raise KVRagError(str(exc)) from None


def sources(chunks: Sequence[Chunk]) -> list[dict[str, Any]]:
    """What an answer read, for `--json`: each retrieved chunk's id, title, source file and text."""
    return [c.as_source(text=True) for c in chunks]


def source_lines(chunks: Sequence[Chunk], width: int = 100) -> str:
    """What an answer read, for `--sources`: one numbered line per chunk (title, file, id) and the first
    line of its text."""
    out = ["sources:"]
    for i, c in enumerate(chunks, 1):
        where = " ".join(p for p in (c.title and f"{c.title!r}", c.metadata.get("source") and f"({c.metadata['source']})") if p)
        first = next((ln.strip() for ln in c.text.splitlines() if ln.strip()), "")
        out.append(f"  [{i}] {where + ' ' if where else ''}id={c.id}")
        out.append(f"      {first if len(first) <= width else first[: width - 3] + '...'}")
    return "\n".join(out)


def read_whole_flags(args: argparse.Namespace) -> dict:
    """--min-recompute, --short-context and --records-whole as AnswerOptions fields (None: not given,
    the engine's or the server's default applies)."""
    return {"min_recompute": args.min_recompute, "short_context": args.short_context,
            "records_whole": None if args.records_whole is None else args.records_whole == "on"}


def _ask_via_server(args: argparse.Namespace, params: dict) -> int:
    """Retrieval here when this machine has an index, else the server's own (what it ingested)."""
    from kvrag.client import ask_retrieving_via_server, ask_via_server

    if args.evict_budget is not None:
        raise KVRagError("--evict-budget is not available through --server")
    if args.compare:
        raise KVRagError("--compare is not available through --server (it answers twice on this machine's model)")
    if args.draft_tokens is not None:
        raise KVRagError("--draft-tokens is not available through --server (the server decodes with its default)")
    if getattr(args, "ape", None) is not None:
        raise KVRagError("--ape is not available through --server (the server answers with its default's)")
    options = dict(method=args.method, recompute_ratio=args.recompute_ratio, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, stop_at=args.stop_at, params=params, policy=read_whole_flags(args))
    if common.index_size(args):
        chunks = common.retrieve(common.open_index(args), args.question, args.top_k)
        text, stats = ask_via_server(args.server, args.question, chunks=chunks, **options)
    else:
        text, stats, chunks = ask_retrieving_via_server(args.server, args.question, top_k=args.top_k, **options)
        if not chunks:
            raise KVRagError(f"{common.NOTHING_INGESTED}: neither this machine's index nor the server's holds any chunk")
    if args.json:
        print(json.dumps({"answer": text, "chunk_ids": [c.id for c in chunks], "sources": sources(chunks), "stats": stats.as_dict()}))
    else:
        print(text)
        if args.sources:
            print(source_lines(chunks))
        print(stats.summary(), file=sys.stderr)
    return 0


LONG_K = 10  # chunks the quickstart's long question reads: a realistic RAG context
FOLLOW_UP = "Who was its chief engineer?"  # the sample's follow-up to its first question (the Brannoch Line)


def cmd_quickstart(args: argparse.Namespace) -> int:
    from kvrag.ingest.documents import load_documents

    rag, index = common.open_engine(args)
    chunks = load_documents([sample_corpus_dir()])
    index.add(chunks)
    rag.precompute(chunks, progress=True)
    setting, took = quickstart_default(rag)
    question = args.question or sample_questions()[0]["question"]
    retrieved = common.retrieve(index, question, DEFAULT_K)
    fast = setting.method if setting.method != "full" else DEFAULT_METHOD  # a reuse method to show beside Full
    print(f"\nQ: {question}  ({len(retrieved)} chunks retrieved: a short context)")
    for line in compare_with_full(rag, question, retrieved, ("full", "reuse", None), raw=fast):
        print(line)
    wide = common.retrieve(index, question, LONG_K)
    runs: list[tuple[str | None, dict, str]] = [("full", {}, ""), (None, {}, "")]
    if setting.method == "full":  # the default reads whole here: show what reuse would cost beside it
        runs.append((fast, {}, ", not the default"))
    rows = compare_runs(rag, question, wide, runs)
    print(f"\nThe same question over {len(wide)} chunks ({rows[-1].context_tokens} chunk tokens: approximate reuse applies)")
    for row in rows:
        print(row.line())
    follow = args.follow_up or (FOLLOW_UP if args.question is None else None)
    if follow:
        print(f"\nFollow-up in the same conversation: {follow}")
        print(follow_up_line(rag, question, follow, wide))
    print(f"\n(store: {rag.store.url}; 'agrees' = same answer as Full Attention after normalising; "
          "KL = first-token KL divergence from Full Attention, 0 is identical; 'read whole': a context this short (or "
          "chunks that are records of one kind) is answered with Full Attention by every method (--short-context, "
          "--min-recompute, --records-whole), the same work as Full, so no ratio is shown; 'policy off': the method "
          "alone; each speed-up says which KV it came from: the chunks' stored KV, or the kept first turn (the exact "
          "prefix cache), where the follow-up reads only its new tokens under Full Attention: the same answer token "
          "for token)")
    print(f"default for questions that name no method: {setting.label()}{took}: {setting.why}")
    return 0


def quickstart_default(rag) -> tuple[Any, str]:
    """The engine's default setting, calibrated now (with its progress on stderr) where no calibration is kept,
    so the quickstart ends calibrated and says what was chosen; and how long calibrating took ("" if kept)."""
    import time

    known = rag.peek_default() if hasattr(rag, "peek_default") else rag.default_setting
    if known is not None:
        return known, ""
    print("calibrating the default setting for this model (once per model and device; kept for every later run) ...",
          file=sys.stderr)
    t0 = time.perf_counter()
    setting, _ = rag.calibrate_default(progress=lambda line: print("  " + line, file=sys.stderr))
    return setting, f" (calibrated just now in {(time.perf_counter() - t0) / 60:.1f} min)"


def follow_up_line(rag, question: str, follow_up: str, chunks) -> str:
    """Turn two of a conversation under Full Attention, re-reading everything against reading only its new
    tokens after turn one's kept KV (the exact prefix cache): the speed-up of exact reuse, and the answers."""
    first = rag.chat([{"role": "user", "content": question}], chunks=chunks, method="full", prefix_cache=False)
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": first.text},
             {"role": "user", "content": follow_up}]
    rag.chat(turns, chunks=chunks, method="full", prefix_cache=False)  # warm-up, untimed
    reread = rag.chat(turns, chunks=chunks, method="full", prefix_cache=False)
    rag.chat(turns[:1], chunks=chunks, method="full")  # turn one again, now kept
    kept = rag.chat(turns, chunks=chunks, method="full")  # timed cold: one-time costs count against it
    same = "the same answer" if kept.text == reread.text else "DIFFERS"
    speedup = reread.stats.ttft_s / max(kept.stats.ttft_s, 1e-9)
    return (f"[{'full, turn one kept':>28}] {kept.text}\n{'':31}TTFT {kept.stats.ttft_s * 1000:.0f} ms, {speedup:.1f}x vs "
            f"re-reading ({reread.stats.ttft_s * 1000:.0f} ms); {same}; read {kept.stats.prompt_tokens - kept.stats.prefix_hit_tokens} "
            f"new of {kept.stats.prompt_tokens} prompt tokens")


RAW = {"short_context": 0, "min_recompute": 0, "records_whole": False}  # the read-whole policies off: what a method does alone


@dataclass(frozen=True)
class Comparison:
    """One method's answer beside Full Attention's: the speed-up is never shown without the quality."""

    label: str
    text: str
    ttft_s: float
    full_ttft_s: float
    agrees: bool | None  # None: this is Full Attention itself
    kl: float
    reading: str  # how the context was read ("read whole: ..." or "fusionrag recomputed 15% ...")
    whole_chunks: int = 0
    read_whole: bool = False
    context_tokens: int = 0

    @property
    def speedup(self) -> float:
        return self.full_ttft_s / max(self.ttft_s, 1e-9)

    def quality(self) -> str:
        if self.agrees is None:
            return "reference"
        q = f"{'agrees' if self.agrees else 'DIFFERS'}, KL {self.kl:.3f}"
        if self.read_whole:
            q += f" ({self.context_tokens} chunk tokens)"
        elif self.whole_chunks:
            q += f"; {self.whole_chunks} chunk(s) recomputed whole (whole_chunks)"
        return q

    def line(self) -> str:
        """The answer, then its speed beside Full's (never a ratio where both did the same work, never "sooner"
        for a slower answer) and how close it is to Full's answer."""
        from kvrag.cli.compare_text import first_token_phrase

        if self.agrees is None:
            speed = f"TTFT {self.ttft_s * 1000:.0f} ms"
        elif self.read_whole:
            speed = "read whole: the same as Full"
        else:
            speed = first_token_phrase(self.ttft_s, self.full_ttft_s) + ", from the chunks' stored KV"
        return f"[{self.label:>28}] {self.text}\n{'':31}{speed}; {self.quality()}"

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.label, "answer": self.text, "ttft_s": self.ttft_s, "full_ttft_s": self.full_ttft_s,
                "speedup": self.speedup, "agrees": self.agrees, "first_token_kl": self.kl, "reading": self.reading}


@without_prefix_cache
def compare_runs(rag, question: str, chunks, runs: Sequence[tuple[str | None, dict, str]], **options) -> list[Comparison]:
    """Each run (method, extra options, label suffix) beside Full Attention over the same chunks: its answer,
    TTFT speed-up and agreement. Every setting runs once untimed first, so no one-time cost (first kernels,
    buffers) lands in a printed TTFT; the prefix cache is paused, so each reads what its method reads."""
    from kvrag.eval.metrics import agreement, first_token_kl

    for method, extra, _ in runs:
        rag.prefill(question, chunks=chunks, method=method, **{**options, **extra})
    rag.prefill(question, chunks=chunks, method="full", **options)
    full = rag.prefill(question, chunks=chunks, method="full", **options)
    full_text = rag.decode(full, **options).answer().text
    out = []
    for method, extra, tag in runs:
        name = method or rag.default_method
        pre = full if name == "full" else rag.prefill(question, chunks=chunks, method=method, **{**options, **extra})
        text = full_text if name == "full" else rag.decode(pre, **{**options, **extra}).answer().text
        if method is None:  # the default setting (its ratio and APE as calibrated), named as such
            label = f"default: {rag.default_setting.name}"
        else:
            label = name if name in RATIO_FREE else f"{name}@{options.get('recompute_ratio', DEFAULT_RATIO):g}"
        out.append(Comparison(
            label=label + tag,
            text=text, ttft_s=pre.stats.ttft_s, full_ttft_s=full.stats.ttft_s,
            agrees=None if name == "full" else agreement(text, full_text),
            kl=0.0 if name == "full" else first_token_kl(full.logits, pre.logits),
            reading=pre.stats.reading(), whole_chunks=pre.stats.whole_chunks,
            read_whole=name != "full" and bool(pre.stats.full_reason), context_tokens=pre.stats.context_tokens,
        ))
    return out


def compare_with_full(rag, question: str, chunks, methods, raw: str | None = None) -> list[str]:
    """One line per method (its answer, TTFT speed-up over Full Attention, how close the answer is to Full's);
    `raw`: one more line, that method with the read-whole policies off."""
    runs = [(m, {}, "") for m in methods] + ([(raw, RAW, ", policy off")] if raw else [])
    return [c.line() for c in compare_runs(rag, question, chunks, runs)]


def cmd_methods(args: argparse.Namespace) -> int:
    from kvrag.methods import METHODS

    marks = current_defaults(getattr(args, "model", None))
    for name, cls in sorted(METHODS.items()):
        mine = [f"{s.name} on {device}" for device, s in marks.items() if s.method == name]
        mark = f"   <- the default now ({', '.join(mine)})" if mine else ""
        print(f"{name:12s} {(cls.__doc__ or '').strip().splitlines()[0]}{mark}")
    print(default_lines(getattr(args, "model", None)))
    return 0


def _source(model: str | None) -> str:
    from kvrag.model.loading import BUNDLED_NAME

    if model in (None, "", "bundled"):
        return BUNDLED_NAME
    return str(Path(model).expanduser()) if str(model).endswith(".gguf") else str(model)


def current_defaults(model: str | None) -> dict[str, Any]:
    """The setting a request naming no method gets now on `model`, per device type (kvrag.check.default's
    answer, read without loading anything): the fixed one where calibration is off, else the kept calibration
    ({} where there is none yet: such a request calibrates first)."""
    from kvrag.check.calibration_store import results_for_source, setting_of
    from kvrag.check.default import calibration_enabled
    from kvrag.defaults import FIXED_DEFAULT

    if not calibration_enabled():
        return {"any device": FIXED_DEFAULT}
    return {device: setting_of(r) for device, r in sorted(results_for_source(_source(model)).items())}


def default_lines(model: str | None) -> str:
    """What a request naming no method gets on `model` (default: the bundled model), and why, as its calibration kept it."""
    from kvrag.check.default import calibration_enabled
    from kvrag.defaults import CALIBRATION_KEEP, CALIBRATION_MIN_SPEEDUP, CALIBRATION_SLACK_PER, FIXED_DEFAULT

    rule = (f"the default: calibrated per model, the fastest setting that answers right >= {CALIBRATION_KEEP:.0%} of the "
            f"calibration questions Full Attention answers right, trails Full's right count by at most one in "
            f"{CALIBRATION_SLACK_PER}, and is >= {CALIBRATION_MIN_SPEEDUP:g}x its speed; else full (docs: Methods)")
    if not calibration_enabled():
        return f"{rule}\n  calibration is off ($KVRAG_CALIBRATE=0): every model gets {FIXED_DEFAULT.name}"
    source = _source(model)
    found = current_defaults(model)
    if not found:
        return (f"{rule}\n  {source}: not calibrated yet: its first request that names no method calibrates it first "
                "(minutes on a CPU, with a progress bar; `kvrag quickstart` or `kvrag check-model --calibrate` do it now)")
    return rule + "".join(f"\n  {source} on {device}: {s.note()}" for device, s in found.items())
