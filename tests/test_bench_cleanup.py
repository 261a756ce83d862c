"""Issue #53: a benchmark removes only a store it created, through the store's walk, and says what it
could not remove (each test failed before the fix: `shutil.rmtree(OUT/kv)` took a user's
out/kv/important.py with it, and a symlinked OUT/kv was reported "removed" while nothing was)."""

import argparse
import os

from kvrag.cache_backends import DiskStore, content_key
from kvrag.cache_backends.disk_cleanup import MARKER
from kvrag.cli.bench_run import drop_default_store, run_store
from test_backends import entry

ARGS = argparse.Namespace(store=None, keep_store=False)


def test_a_folder_the_run_did_not_create_is_left_alone(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "kv").mkdir(parents=True)
    (out / "kv" / "important.py").write_text("print('mine')\n")
    assert run_store(out, "kvrag bench").startswith("disk://")
    DiskStore(out / "kv").put(content_key("e"), entry())  # the run used it as its store
    drop_default_store(ARGS, out)
    err = capsys.readouterr().err
    assert (out / "kv" / "important.py").read_text() == "print('mine')\n"
    assert "did not create it" in err and "removed this run" not in err
    assert not (out / "kv" / MARKER).exists()


def test_a_created_store_goes_and_a_file_dropped_into_it_stays_named(tmp_path, capsys):
    out = tmp_path / "out"
    run_store(out, "kvrag bench")
    store = DiskStore(out / "kv")
    store.put(content_key("e"), entry())
    store.link(["ns/a"], [content_key("e")])
    (out / "kv" / "notes.txt").write_text("keep me")
    drop_default_store(ARGS, out)
    err = capsys.readouterr().err
    assert (out / "kv" / "notes.txt").read_text() == "keep me"
    assert "could not remove 1 path(s)" in err and "notes.txt" in err
    assert not list((out / "kv").rglob("*.kv")) and not list((out / "kv").rglob("*.ref"))
    os.unlink(out / "kv" / "notes.txt")
    drop_default_store(ARGS, out)  # a later run into the same folder removes the rest (the marker stayed)
    assert not (out / "kv").exists() and "removed this run's KV store" in capsys.readouterr().err


def test_a_symlinked_out_kv_is_not_followed_nor_reported_removed(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    run_store(elsewhere, "kvrag bench")  # even a marked store behind the link stays
    DiskStore(elsewhere / "kv").put(content_key("e"), entry())
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(elsewhere / "kv", out / "kv")
    run_store(out, "kvrag bench")
    drop_default_store(ARGS, out)
    err = capsys.readouterr().err
    assert "symlink" in err and "removed this run" not in err
    assert len(list((elsewhere / "kv").rglob("*.kv"))) == 1 and (out / "kv").is_symlink()
