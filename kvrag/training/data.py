"""Training data: JSONL rows with provenance, and the examples built from them (laid out as at inference)."""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from kvrag.chat import Conversation
from kvrag.eval.data import parse_range
from kvrag.kv.layout import Links, PromptLayout, Segments
from kvrag.fuse.links import link_picture
from kvrag.types import Chunk

EVAL_FILE = "nq10_dev.jsonl"
EVAL_ROWS = (1200, 1600)  # never trained on: the evaluation split


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_rows(specs: Sequence[str], default_rows: str = "0:1200", allow_eval_rows: bool = False) -> tuple[list[dict], list[dict]]:
    """Rows of every `PATH[@START:END]` and their provenance (path, sha256, range, count, sources)."""
    rows: list[dict] = []
    provenance: list[dict] = []
    for spec in specs:
        path_s, _, rng = spec.partition("@")
        path = Path(path_s).expanduser()
        start, end = parse_range(rng or default_rows)
        if path.name == EVAL_FILE and not allow_eval_rows:
            hi = end if end is not None else 1 << 30
            if start < EVAL_ROWS[1] and hi > EVAL_ROWS[0]:
                raise ValueError(
                    f"rows {start}:{end} of {path.name} overlap {EVAL_ROWS[0]}-{EVAL_ROWS[1] - 1}, the evaluation split, "
                    "which is never trained on (use rows 0:1200)"
                )
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, start=1) if line.strip()]
        picked = [_row(path, n, line) for n, line in lines[start:end]]
        sources = sorted({str(r.get("source", "")) for r in picked if r.get("source")})
        provenance.append(
            {
                "path": str(path),
                "file": path.name,
                "sha256": file_sha256(path),
                "rows": f"{start}:{end if end is not None else len(lines)}",
                "count": len(picked),
                "sources": sources[:8] + ([f"... {len(sources) - 8} more"] if len(sources) > 8 else []),
            }
        )
        rows.extend(picked)
    return rows, provenance


def _row(path: Path, line_no: int, line: str) -> dict:
    """One training row, or a clear error naming its file and line (nothing is trained on a bad file)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}, line {line_no}: not a JSON object ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}, line {line_no}: a row must be a JSON object, got {type(row).__name__}")
    ctxs = row.get("ctxs")
    if not isinstance(row.get("question", ""), str) or not isinstance(ctxs, list) or not all(
            isinstance(c, dict) and isinstance(c.get("text"), str) for c in ctxs):
        raise ValueError(f"{path}, line {line_no}: a row needs 'question' (text) and 'ctxs' (a list of {{title, text}})")
    return row


@dataclass
class Example:
    segments: Segments  # with link slots
    answer: list[int]  # answer token ids (+ end of turn)
    gold: int | None  # the gold passage's chunk index after shuffling
    chunks: list[Chunk] = field(default_factory=list)  # the passages, in prompt order
    kind: str = "qa"  # "qa" (a question over passages) or "continue" (objective distill: the text goes on)

    @property
    def length(self) -> int:
        return self.segments.total_len + len(self.answer)


def shuffled_passages(row: dict, rng: random.Random) -> tuple[list[dict], int | None]:
    """The row's passages in a shuffled order with the gold one at a random position (KVLink App. A.5)."""
    ctxs = list(row.get("ctxs") or [])
    gold = row.get("gold_index")
    if gold is None or not 0 <= int(gold) < len(ctxs):
        rng.shuffle(ctxs)
        return ctxs, None
    g = ctxs.pop(int(gold))
    rng.shuffle(ctxs)
    at = rng.randrange(len(ctxs) + 1)
    ctxs.insert(at, g)
    return ctxs, at


def answer_ids(layout: PromptLayout, answer: str) -> list[int]:
    tok = layout.tokenizer
    ids = list(tok(answer, add_special_tokens=False)["input_ids"])
    eos = getattr(tok, "eos_token_id", None)
    return ids + ([int(eos)] if isinstance(eos, int) else [])


def qa_chunks(row: dict, rng: random.Random, max_chunks: int, min_chunks: int | None = None) -> tuple[list[Chunk], int | None]:
    """A QA example's passages (shuffled, the gold one at a random place and always kept) and the gold index."""
    ctxs, gold = shuffled_passages(row, rng)
    keep = max_chunks if min_chunks is None else rng.randint(min(min_chunks, max_chunks), max_chunks)
    if gold is not None and gold >= keep:  # keep the gold passage: it replaces the last one kept
        ctxs, gold = ctxs[: keep - 1] + [ctxs[gold]], keep - 1
    ctxs = ctxs[:keep]
    return [Chunk(id=f"p{i}", text=str(c.get("text", "")), title=str(c.get("title", "") or "")) for i, c in enumerate(ctxs)], gold


def build_example(
    layout: PromptLayout, row: dict, rng: random.Random, links: Links | int, max_chunks: int, max_tokens: int,
    min_chunks: int | None = None,
) -> Example:
    """One training prompt from a row. With `min_chunks`, the example keeps a random number of passages
    from min_chunks to max_chunks (the gold one among them), so the model also sees prompts with few
    chunks, as a RAG app with a small top-k sends; None keeps up to max_chunks (and draws nothing)."""
    chunks, gold = qa_chunks(row, rng, max_chunks, min_chunks)
    ans = answer_ids(layout, str((row.get("answers") or [""])[0]))
    return fit_example(layout, chunks, gold, layout.question_ids(str(row["question"])), ans, links, max_tokens, len(ans))


def fit_example(
    layout: PromptLayout, chunks: list[Chunk], gold: int | None, question: list[int], answer: list[int], links: Links | int,
    max_tokens: int, reserve: int, kind: str = "qa",
) -> Example:
    """The example of these chunks, with trailing non-gold chunks dropped until the prompt plus
    `reserve` answer tokens fits `max_tokens` (one chunk is always kept)."""
    links = Links.of(links)
    return _fit(lambda cs: Segments(list(layout.prefix_ids), [layout.chunk_ids(c) for c in cs], question, links=links.count,
                                    link_scope=links.scope), chunks, gold, answer, max_tokens, reserve, kind)


def fit_conversation(
    layout: PromptLayout, chunks: list[Chunk], gold: int | None, conv: Conversation, links: Links | int, max_tokens: int, reserve: int,
) -> Example:
    """`fit_example` for a conversation: its segments as the engine lays out a chat over these chunks."""
    return _fit(lambda cs: layout.conversation_segments([layout.chunk_ids(c) for c in cs], conv, links=links),
                chunks, gold, [], max_tokens, reserve, "turn2")


def _fit(build: Callable[[list[Chunk]], Segments], chunks: list[Chunk], gold: int | None, answer: list[int], max_tokens: int,
         reserve: int, kind: str) -> Example:
    while True:
        seg = build(chunks)
        if seg.total_len + reserve <= max_tokens or len(chunks) <= 1:
            return Example(seg, answer, gold, chunks, kind)
        drop = max(i for i in range(len(chunks)) if i != gold)  # the last non-gold passage
        chunks = chunks[:drop] + chunks[drop + 1 :]
        if gold is not None and gold > drop:
            gold -= 1


# -- objective distill: example kinds ----------------------------------------------------------------
# The question slot of a "continue" example: the prompt is what `rag.answer(CONTINUE_INSTRUCTION,
# chunks=...)` reads (the layout's question template and assistant turn), so the teacher continues
# in the assistant turn, as every answer at inference is generated.
CONTINUE_INSTRUCTION = "Continue the text."
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


# The follow-ups of a "turn2" example: label-free second questions about the same passages (the teacher
# answers them; no row holds an answer to them)
FOLLOW_UPS = (
    "Which document says so?",
    "Can you say that in one sentence?",
    "What else do the documents say about it?",
    "Are you sure? Check the documents again.",
    "Why?",
)


def example_kind(seed: int, epoch: int, row_index: int, continue_share: float, row: dict | None = None, turn_share: float = 0.0) -> str:
    """The kind of the example of row `row_index` in `epoch`: "continue" for about `continue_share`
    of them, "turn2" (a two-turn conversation) for about `turn_share`, else "qa"; a pure function of the
    seed (a resumed run sees the same kinds; with turn_share 0 the kinds of earlier runs). A row without
    a question is always "continue"; one without an answer is never "turn2"."""
    if row is not None and not str(row.get("question") or "").strip():
        return "continue"
    if continue_share <= 0 and turn_share <= 0:
        return "qa"
    draw = random.Random(f"{seed}:{epoch}:{row_index}:kind").random()
    if draw < continue_share:
        return "continue"
    has_answer = row is None or any(str(a).strip() for a in (row.get("answers") or []))
    return "turn2" if draw < continue_share + turn_share and has_answer else "qa"


def split_sentences(text: str, pieces: int) -> list[str]:
    """`text` cut at sentence ends into at most `pieces` runs of sentences of about equal length."""
    sentences = [s for s in _SENTENCE_END.split(text.strip()) if s]
    pieces = max(1, min(pieces, len(sentences)))
    total = sum(len(s) + 1 for s in sentences)
    out, cur, done = [], [], 0
    for i, s in enumerate(sentences):
        cur.append(s)
        done += len(s) + 1
        left = len(sentences) - i - 1
        if len(out) < pieces - 1 and (done >= total * (len(out) + 1) / pieces or left == pieces - 1 - len(out)):
            out.append(" ".join(cur))
            cur = []
    if cur:
        out.append(" ".join(cur))
    return out


def continue_chunks(row: dict, rng: random.Random, max_chunks: int) -> list[Chunk]:
    """The chunks of a "continue" example (no question): half the time some of the row's passages
    in a shuffled order (titled, as QA examples show them), else one passage cut at sentence ends
    into 2-4 untitled pieces (its title on the first line of the first, as a user's document
    chunks read), so the text runs on across chunk boundaries."""
    ctxs = [c for c in (row.get("ctxs") or []) if str(c.get("text", "")).strip()]
    if not ctxs:
        raise ValueError(f"row {row.get('id', '?')!r} has no passage text to continue")
    if rng.random() < 0.5:
        c = ctxs[rng.randrange(len(ctxs))]
        title = str(c.get("title", "") or "").strip()
        text = (title + "\n" if title else "") + str(c["text"]).strip()
        pieces = split_sentences(text, rng.randint(2, 4))
        if len(pieces) > 1:
            return [Chunk(id=f"s{i}", text=t) for i, t in enumerate(pieces[:max_chunks])]
    rng.shuffle(ctxs)
    keep = rng.randint(min(2, len(ctxs), max_chunks), min(len(ctxs), max_chunks))
    return [Chunk(id=f"p{i}", text=str(c.get("text", "")), title=str(c.get("title", "") or "")) for i, c in enumerate(ctxs[:keep])]


def build_distill_example(
    layout: PromptLayout, row: dict, rng: random.Random, kind: str, links: Links | int, max_chunks: int, max_tokens: int,
    reserve: int, min_chunks: int | None = None,
) -> Example:
    """An example of objective distill, its answer still empty (the teacher's continuation goes
    there): "qa" lays out the row's passages and question as `build_example` does (the same
    draws), "continue" the row's passage text with `CONTINUE_INSTRUCTION`, "turn2" the qa example's passages
    and question with the row's first answer as the assistant's reply, then a follow-up (`FOLLOW_UPS`) the
    teacher answers. Only "turn2" reads a row's answer, as a turn of the conversation, never as a target;
    `reserve` (the teacher's token budget) stands in for the answer's length."""
    if kind == "turn2":
        chunks, gold = qa_chunks(row, rng, max_chunks, min_chunks)
        first = str(next(a for a in row.get("answers") or [] if str(a).strip())).strip()
        conv = Conversation(turns=(("user", str(row["question"])), ("assistant", first), ("user", rng.choice(FOLLOW_UPS))))
        return fit_conversation(layout, chunks, gold, conv, links, max_tokens, reserve)
    if kind == "continue":
        chunks = continue_chunks(row, rng, max_chunks)
        return fit_example(layout, chunks, None, layout.question_ids(CONTINUE_INSTRUCTION), [], links, max_tokens, reserve, kind)
    if kind != "qa":
        raise ValueError(f"example kind must be 'qa', 'continue' or 'turn2', got {kind!r}")
    chunks, gold = qa_chunks(row, rng, max_chunks, min_chunks)
    return fit_example(layout, chunks, gold, layout.question_ids(str(row["question"])), [], links, max_tokens, reserve)


def training_mask(segments: Segments, length: int) -> torch.Tensor:
    """Boolean [length, length]: KVLink's picture over prompt + answer. Every mask the model sees, in
    training (both stages) and at inference (the recompute pass), is a block of this one."""
    pos = torch.arange(length)
    return link_picture(segments, pos, pos)


def context_positions(segments: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """Global and precompute-time (local) positions of the context tokens: the prefix, then every chunk's tokens.

    A chunk's KV is computed with the chunk right after the prefix (local positions), then its keys
    are re-rotated to where the chunk sits in the prompt (global positions), as at inference.
    """
    p = len(segments.prefix)
    glob, loc = [torch.arange(p)], [torch.arange(p)]
    for start, chunk in zip(segments.chunk_starts, segments.chunks):
        glob.append(torch.arange(start, start + len(chunk)))
        loc.append(torch.arange(p, p + len(chunk)))
    return torch.cat(glob), torch.cat(loc)
