"""The bundled sample corpus and its questions (quickstart, the demo, `kvrag bench --quick`)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def sample_corpus_dir() -> Path:
    return Path(str(resources.files("kvrag") / "sample_corpus"))


def sample_questions() -> list[dict]:
    return json.loads((resources.files("kvrag") / "sample_questions.json").read_text())
