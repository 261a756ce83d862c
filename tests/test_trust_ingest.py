"""Issue #53: `kvrag ingest` names every file it skips in a folder, and why (it passed over a FIFO and
a whitespace-only file in silence before)."""

import argparse
import os

from kvrag.cli.ingest import _ingest_files


def test_ingest_names_a_fifo_a_blank_file_and_unsupported_types(tmp_path, capsys):
    (tmp_path / "good.txt").write_text("Owls hunt at night.\n")
    (tmp_path / "blank.md").write_text("  \n\t\n\u3000\n")
    (tmp_path / "empty.txt").write_text("")
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "script.py").write_text("print(1)\n")
    os.symlink(tmp_path / "pipe.txt", tmp_path / "link.md")
    args = argparse.Namespace(paths=[str(tmp_path)], follow_symlinks=False)
    files, skipped = _ingest_files(args)
    err = capsys.readouterr().err
    assert [f.name for f in files] == ["good.txt"]
    assert sorted(os.path.basename(s.split(": ")[0]) for s in skipped) == ["blank.md", "empty.txt", "link.md", "pipe.txt"]
    assert all(": " in s for s in skipped)  # each with why
    assert "pipe.txt: a FIFO (named pipe), not a regular file" in err
    assert "blank.md: it holds no text" in err and "empty.txt: it holds no text" in err
    assert "link.md: a symlink to" in err and "which is a FIFO" in err
    assert "script.py" in err and "unsupported types" in err
