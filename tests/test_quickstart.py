"""`kvrag quickstart`, the README's main job, on the real bundled model: every line beside its speed says
how close the answer is to Full Attention's, and a context this short says it was read whole."""

import pytest

from kvrag.cli import main

pytestmark = pytest.mark.smollm


def test_quickstart_shows_quality_beside_every_speedup(tmp_path, monkeypatch, capsys, smollm, shipped_defaults):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    assert main(["quickstart", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "x vs Full" in line]
    assert len(rows) == 4, out  # full, reuse, the default, the default with the policy off
    assert "reference" in rows[0] and all(("agrees" in r or "DIFFERS" in r) and "KL" in r for r in rows[1:])
    assert "read whole" in rows[2] and "read whole" not in rows[3] and "policy off" in out
    assert "1893" in out.split("[")[1]  # Full Attention's answer to the sample's first question
