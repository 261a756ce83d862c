"""Training data: JSONL rows with provenance, and the examples built from them (laid out as at inference)."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from kvrag.eval.data import parse_range
from kvrag.layout import PromptLayout, Segments
from kvrag.links import link_picture
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
            lines = [line for line in f if line.strip()]
        picked = [json.loads(line) for line in lines[start:end]]
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


@dataclass
class Example:
    segments: Segments  # with link slots
    answer: list[int]  # answer token ids (+ end of turn)
    gold: int | None  # the gold passage's chunk index after shuffling
    chunks: list[Chunk] = field(default_factory=list)  # the passages, in prompt order

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


def build_example(
    layout: PromptLayout, row: dict, rng: random.Random, link_tokens: int, max_chunks: int, max_tokens: int,
    min_chunks: int | None = None,
) -> Example:
    """One training prompt from a row. With `min_chunks`, the example keeps a random number of passages
    from min_chunks to max_chunks (the gold one among them), so the model also sees prompts with few
    chunks, as a RAG app with a small top-k sends; None keeps up to max_chunks (and draws nothing)."""
    ctxs, gold = shuffled_passages(row, rng)
    keep = max_chunks if min_chunks is None else rng.randint(min(min_chunks, max_chunks), max_chunks)
    if gold is not None and gold >= keep:  # keep the gold passage: it replaces the last one kept
        ctxs, gold = ctxs[: keep - 1] + [ctxs[gold]], keep - 1
    ctxs = ctxs[:keep]
    chunks = [Chunk(id=f"p{i}", text=str(c.get("text", "")), title=str(c.get("title", "") or "")) for i, c in enumerate(ctxs)]
    ans = answer_ids(layout, str((row.get("answers") or [""])[0]))
    question = layout.question_ids(str(row["question"]))
    while True:
        seg = Segments(list(layout.prefix_ids), [layout.chunk_ids(c) for c in chunks], question, links=link_tokens)
        if seg.total_len + len(ans) <= max_tokens or len(chunks) <= 1:
            return Example(seg, ans, gold, chunks)
        drop = max(i for i in range(len(chunks)) if i != gold)  # the last non-gold passage
        chunks = chunks[:drop] + chunks[drop + 1 :]
        if gold is not None and gold > drop:
            gold -= 1


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
