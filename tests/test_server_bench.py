"""scripts/server_bench.py keeps what it measured: its tables are rewritten after every client count,
so a run cut part-way (a lent GPU's step killed at its time limit) leaves valid tables marked partial."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import threading
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "server_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("server_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Killed(BaseException):
    """Stands in for the signal that ends a step at its cap (not an Exception: nothing may catch it)."""


def answers_then_killed(limit: int):
    """A stream_question that answers `limit` requests, then is killed."""
    lock, calls = threading.Lock(), [0]

    def stream(url, question, chunk_ids, args):
        with lock:
            calls[0] += 1
            if calls[0] > limit:
                raise Killed()
        return {"ttft_s": 0.1, "total_s": 0.2, "engine_ttft_s": 0.05, "text": "x", "prompt_tokens": 10, "generated_tokens": 2}

    return stream


def args_for(bench, tmp_path: Path) -> argparse.Namespace:
    return bench.parse_args(["--out", str(tmp_path), "--n", "3", "--cli-n", "0", "--concurrency", "1,2,4"])


def test_a_run_killed_after_its_first_client_count_leaves_valid_partial_tables(bench, tmp_path, monkeypatch):
    args = args_for(bench, tmp_path)
    work = [(f"q{i}", ["c1"]) for i in range(3)]
    monkeypatch.setattr(bench, "stream_question", answers_then_killed(limit=3))  # 1 client: 3 requests
    result = bench.new_result(args, "http://x", "tiny", [1, 2, 4])
    with pytest.raises(Killed):
        bench.measure_levels("http://x", work, [1, 2, 4], args, result, functools.partial(bench.save_tables, tmp_path))

    saved = json.loads((tmp_path / "server_bench.json").read_text())
    assert saved["complete"] is False and saved["planned_client_counts"] == [1, 2, 4]
    assert [lv["clients"] for lv in saved["concurrency"]] == [1] and saved["concurrency"][0]["requests"] == 3
    md = (tmp_path / "server_bench.md").read_text()
    assert "partial: 1 of 3 client counts" in md
    assert "\n| 1 | 3 | " in md and "\n| 2 | " not in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server_bench.json", "server_bench.md"]  # no temp file left


def test_a_finished_run_is_marked_complete(bench, tmp_path, monkeypatch):
    args = args_for(bench, tmp_path)
    monkeypatch.setattr(bench, "stream_question", answers_then_killed(limit=1000))
    result = bench.new_result(args, "http://x", "tiny", [1, 2])
    bench.measure_levels("http://x", [("q", ["c1"])], [1, 2], args, result, functools.partial(bench.save_tables, tmp_path))
    assert "partial:" in (tmp_path / "server_bench.md").read_text()  # not finished until the run says so
    result["complete"] = True
    md = bench.save_tables(tmp_path, result)
    assert json.loads((tmp_path / "server_bench.json").read_text())["complete"] is True
    assert "partial:" not in md and (tmp_path / "server_bench.md").read_text() == md
