"""Evaluation examples from JSONL files shaped like shared/data/*.jsonl (never downloaded)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvrag.documents import chunk_id
from kvrag.types import Chunk


@dataclass(frozen=True)
class Example:
    id: str
    question: str
    answers: list[str]
    chunks: list[Chunk]
    gold_index: int | None = None


def load_examples(path: str | Path, n: int | None = None, seed: int = 0) -> list[Example]:
    """Read `{id, question, answers[], ctxs[{title,text}], gold_index}` rows; a seeded sample of `n` if given."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no dataset at {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                chunks = [
                    Chunk(chunk_id(c.get("title", ""), c["text"]), c["text"], c.get("title", "")) for c in row["ctxs"]
                ]
                rows.append(
                    Example(str(row.get("id", lineno)), row["question"], list(row["answers"]), chunks, row.get("gold_index"))
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not an evaluation row ({exc})") from None
    if n is not None and n < len(rows):
        rows = random.Random(seed).sample(rows, n)
    return rows
