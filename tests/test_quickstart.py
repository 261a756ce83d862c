"""`kvrag quickstart`, the README's main job, on the real bundled model: every line beside its speed says
how close the answer is to Full Attention's, and a context this short says it was read whole."""

import pytest

from kvrag.cli import main

pytestmark = pytest.mark.smollm


def test_quickstart_shows_quality_beside_every_speedup(tmp_path, monkeypatch, capsys, smollm, shipped_defaults):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    assert main(["quickstart", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    short = out[out.index("Q: "):out.index("The same question over")]
    long_ = out[out.index("The same question over"):out.index("Follow-up in the same conversation")]
    follow = out[out.index("Follow-up in the same conversation"):out.index("(store: ")]
    rows = _rows(short)
    assert len(rows) == 4, out  # full, reuse, the default, the default with the policy off
    assert "reference" in rows[0][1] and all(("agrees" in r or "DIFFERS" in r) and "KL" in r for _, r in rows[1:])
    # read whole: the same work as Full, said so, with no ratio; the policy off: a ratio, never "sooner" if slower
    assert "default: " in rows[2][0] and "read whole: the same as Full" in rows[2][1] and "x " not in rows[2][1]
    assert "read whole" not in rows[3][1] and "policy off" in rows[3][0]
    assert ("x sooner" in rows[3][1] or "x slower" in rows[3][1] or "about as soon" in rows[3][1])
    assert "1893" in out.split("[")[1]  # Full Attention's answer to the sample's first question
    # the long question: ten chunks, the default reuses them (no "read whole"), its quality beside its speed
    rows = _rows(long_)
    assert "over 10 chunks" in long_ and len(rows) == 2 and "reference" in rows[0][1]
    assert ("agrees" in rows[1][1] or "DIFFERS" in rows[1][1]) and "KL" in rows[1][1] and "read whole" not in rows[1][1]
    assert "from the chunks' stored KV" in rows[1][1]  # which cache the speed-up came from
    assert "default for questions that name no method: fusionrag@0.15 (fixed)" in out  # calibration is off here
    # the follow-up: exact reuse of the kept first turn, the same answer as re-reading everything
    assert "Who was its chief engineer?" in follow and "the same answer" in follow and "Isobel Carrick" in follow
    new, total = map(int, follow.split("read ")[1].split(" prompt")[0].split(" new of "))
    assert new < 40 < 1000 < total


def _rows(block: str) -> list[tuple[str, str]]:
    """Each setting's two lines: "[label] answer" and the speed and quality under it."""
    lines = block.splitlines()
    return [(line, lines[k + 1]) for k, line in enumerate(lines) if line.startswith("[") and k + 1 < len(lines)]
