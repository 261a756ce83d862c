"""A short fault soak (issue #18): two threads answer for ~18 s while a real redis-server is killed
and restarted empty, frozen, squeezed to a tiny maxmemory (noeviction, then allkeys-lru) and flushed.
No answer may raise, and every answer must equal the fault-free one (greedy decoding: a miss
recomputes exactly the same KV). The full soak is `python scripts/fault_soak.py --seconds 120`."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
pytest.importorskip("redis")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fault_soak.py"


def load_soak():
    if "fault_soak" not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location("fault_soak", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["fault_soak"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["fault_soak"]


def test_schedule_cycles_through_every_fault_kind_and_ends_in_time():
    soak = load_soak()
    plan = soak.FaultPlan(every=3.5, first=1.0, down_s=1.0, freeze_s=1.5, squeeze_s=2.5)
    sched = plan.schedule(18)
    assert [k for _, k in sched] == list(soak.FAULT_KINDS)
    assert all(t >= 1.0 for t, _ in sched) and sched[-1][0] <= 17
    full = soak.FaultPlan().schedule(120)
    assert {k for _, k in full} == set(soak.FAULT_KINDS) and len(full) >= 7


def test_short_fault_soak_no_exception_and_every_answer_identical(tmp_path):
    soak = load_soak()
    plan = soak.FaultPlan(every=3.5, first=1.0, down_s=1.0, freeze_s=1.5, squeeze_s=2.5, maxmemory="1mb")
    res = soak.run_soak(seconds=18, threads=2, out=tmp_path, model="tiny", plan=plan, n_chunks=8, n_questions=3, quiet=True)
    s = res["summary"]
    assert [f["kind"] for f in res["faults"]] == list(soak.FAULT_KINDS)
    assert s["fault_driver_errors"] == 0, res["faults"]
    assert s["exceptions"] == 0, res["exceptions"][:3]
    assert s["miss_path_differences"] == 0, res["miss_path_differences"][:3]
    assert s["answers"] > 0 and s["different"] == 0 and s["identical"] == s["answers"], res["differences"][:3]
    assert s["in_faults"]["answers"] > 0 and s["in_faults"]["misses"] > 0  # the faults did reach the answers
    assert s["outside_faults"]["answers"] > 0
    saved = json.loads((tmp_path / "soak.json").read_text())
    assert saved["summary"] == s
    md = (tmp_path / "soak.md").read_text()
    assert "| during faults |" in md and "| without faults |" in md and "Hardware:" in md
