"""Evaluation examples from JSONL files shaped like shared/data/*.jsonl (never downloaded)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvrag.ingest.documents import chunk_id
from kvrag.ingest.samples import sample_corpus_dir, sample_questions
from kvrag.types import Chunk


@dataclass(frozen=True)
class Example:
    id: str
    question: str
    answers: list[str]
    chunks: list[Chunk]
    gold_index: int | None = None


def parse_range(spec: str) -> tuple[int, int | None]:
    """'1200:1600' -> (1200, 1600); '1200:' -> (1200, None)."""
    start, _, end = spec.partition(":")
    return int(start or 0), (int(end) if end else None)


def load_examples(path: str | Path, n: int | None = None, seed: int = 0) -> list[Example]:
    """Read `{id, question, answers[], ctxs[{title,text}], gold_index}` rows; a seeded sample of `n` if given.

    `PATH@START:END` keeps only those rows (0-based, end excluded) before sampling, so an evaluation
    split such as nq10_dev rows 1200-1599 is named the same way `kvrag train-links` names its rows.
    """
    path_s, _, rows_spec = str(path).partition("@")
    start, end = parse_range(rows_spec) if rows_spec else (0, None)
    path = Path(path_s)
    if not path.is_file():
        raise FileNotFoundError(f"no dataset at {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(example_from_row(json.loads(line), str(lineno)))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not an evaluation row ({exc})") from None
    rows = rows[start:end]
    if n is not None and n < len(rows):
        rows = random.Random(seed).sample(rows, n)
    return rows


def example_from_row(row: dict, fallback_id: str = "") -> Example:
    """One `{id, question, answers[], ctxs[{title,text}], gold_index}` row as an Example."""
    chunks = [Chunk(chunk_id(c.get("title", ""), c["text"]), c["text"], c.get("title", "")) for c in row["ctxs"]]
    return Example(str(row.get("id", fallback_id)), row["question"], list(row["answers"]), chunks, row.get("gold_index"))


def sample_examples(n: int | None = None, seed: int = 0, chunks_per_question: int = 6, phrasings: bool = False) -> list[Example]:
    """Examples from the bundled sample corpus and questions, for a benchmark with no dataset at hand.

    Each question gets its own document's chunks plus other documents' chunks as distractors, in a
    seeded order, so the gold passage is not always first. `phrasings=True`: every phrasing of each
    question (sample_questions.json "phrasings") is an example of its own over the same chunks.
    """
    from kvrag.ingest.documents import load_documents

    chunks = load_documents([sample_corpus_dir()])
    rng = random.Random(seed)
    out = []
    for i, q in enumerate(sample_questions()):
        doc = [c for c in chunks if Path(str(c.metadata.get("source", ""))).name == q["file"]]
        gold = [c for c in doc if q["answer"].lower() in c.text.lower()][:1] or doc[:1]
        others = [c for c in chunks if c not in gold]
        picked = gold + rng.sample(others, chunks_per_question - len(gold))
        rng.shuffle(picked)
        asked = [q["question"], *q.get("phrasings", [])] if phrasings else [q["question"]]
        out += [Example(f"sample-{i}" + (f"-{j}" if j else ""), text, [q["answer"]], picked) for j, text in enumerate(asked)]
    if n is not None and n < len(out):
        out = random.Random(seed).sample(out, n)
    return out
