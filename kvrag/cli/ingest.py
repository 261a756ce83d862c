"""`kvrag ingest`: files checked before any model loads, then chunks read, their KV stored and only
then indexed, a batch at a time, with a progress bar per stage.

Memory stays flat in the files' size: files are read as they are chunked, each forward batch's KV is
written to the store and dropped before the next, and a batch is indexed only once its KV is stored,
so an interrupted ingest keeps what it stored (no index entry without its KV) and a rerun completes
the rest. A bad file found in a folder is named on stderr and skipped (exit EXIT_SKIPPED when the
rest went in); one named on the command line is an error before anything loads.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvrag.cli import common
from kvrag.cli.args import positive_int
from kvrag.cli.common import add_engine_options, add_server_option
from kvrag.errors import KVRagError, StoreUnavailableError
from kvrag.ingest.splitting import DEFAULT_MAX_CHUNK_TOKENS
from kvrag.defaults import kvrag_home
from kvrag.types import Chunk

__all__ = ["EXIT_INTERRUPTED", "EXIT_SKIPPED", "INGEST_BATCH", "run_ingest"]

# `kvrag ingest` reads, stores and indexes this many chunks at a time: a group is in the vector index
# only once its KV is in the store, and nothing of it is kept when the next group is read.
INGEST_BATCH = 128
EXIT_SKIPPED = 3  # ingest: everything else was ingested, but some files were skipped (named on stderr)
EXIT_INTERRUPTED = 130


def run_ingest(args: argparse.Namespace, open_engine: Callable[[], tuple[Any, Any]], open_index: Callable[[], Any]) -> int:
    """`kvrag ingest`: check every file (before any model loads), then stream: chunks are read
    INGEST_BATCH at a time, their KV computed and stored (each forward batch as soon as it is
    computed), and only then are they indexed, so an interrupted ingest leaves an index of chunks
    whose KV is stored, and running it again completes the rest (cached KV and unchanged index
    entries are not redone). `open_engine()`: (engine, index), called once the files are checked;
    `open_index()`: this machine's index alone (with --server, for a server that does not retrieve)."""
    files, skipped = _ingest_files(args)
    if not files:
        print("no text found in the given paths", file=sys.stderr)
        return 1
    if args.server:
        code = _ingest_via_server(args, files, skipped, open_index)
    else:
        code = _ingest_locally(args, files, skipped, open_engine)
    if skipped:
        print(_skipped_summary(skipped), file=sys.stderr)
        return code or EXIT_SKIPPED
    return code


SKIPPED_SHOWN = 10  # the closing summary names this many skipped files, each with why


def _skipped_summary(skipped: Sequence[str]) -> str:
    """The closing word on skipped files, each with why ("skipped notes.bin: not a text file (...)"): the
    warnings printed as each was found have scrolled away behind the progress bars by then."""
    lines = [f"kvrag: {len(skipped)} file(s) skipped:"] + [f"kvrag:   skipped {s}" for s in skipped[:SKIPPED_SHOWN]]
    if len(skipped) > SKIPPED_SHOWN:
        lines.append(f"kvrag:   ... and {len(skipped) - SKIPPED_SHOWN} more (each named with why above)")
    return "\n".join(lines)


def _why(path: Path | str, problem: str) -> str:
    """`path: problem`, the path said once (most problems already start with it)."""
    return problem if problem.startswith(str(path)) else f"{path}: {problem}"


def _ingest_files(args: argparse.Namespace) -> tuple[list[Path], list[str]]:
    """The files to ingest, each read through once before any model loads: a bad file named on the
    command line is an error (exit 2); a bad one found in a folder is reported and skipped ("path: why"
    in the list returned beside the files). A folder's symlinks that lead out of it are not
    followed without --follow-symlinks (each one named on stderr). Every file left out is named with
    why: not text, a FIFO or other special file, only whitespace, an unsupported type (a note)."""
    from kvrag.ingest.documents import SkippedPath, document_files

    files: list[Path] = []
    skipped: list[str] = []
    walk_notes: list[SkippedPath] = []
    for raw in args.paths:
        path = Path(raw)
        if not path.is_dir():
            for f in document_files([path]):  # a file named is read as given (a symlink too)
                problem = _file_problem(f)
                if problem is not None:
                    raise KVRagError(problem)
                files.append(f)
            continue
        for f in document_files([path], follow_symlinks=args.follow_symlinks, skipped=walk_notes):
            problem = _file_problem(f)
            if problem is None:
                files.append(f)
            else:
                print(f"kvrag: warning: skipping {problem}", file=sys.stderr)
                skipped.append(_why(f, problem))
    blank = [f for f in files if _blank(f)]
    for f in blank:
        print(f"kvrag: warning: skipping {f}: it holds no text (empty, or only whitespace)", file=sys.stderr)
        skipped.append(f"{f}: it holds no text (empty, or only whitespace)")
    files = [f for f in files if f not in blank]
    unsupported = [n for n in walk_notes if n.unsupported]
    if unsupported:
        from kvrag.ingest.documents import SUPPORTED_EXTENSIONS

        names = ", ".join(str(n.path) for n in unsupported[:20]) + (f" and {len(unsupported) - 20} more" if len(unsupported) > 20 else "")
        print(f"kvrag: note: not ingesting {len(unsupported)} file(s) of unsupported types (ingested: "
              f"{', '.join(SUPPORTED_EXTENSIONS)}): {names}", file=sys.stderr)
    for note in walk_notes:
        if note.unsupported:
            continue
        if note.symlink:
            print(f"kvrag: note: not following {note.path}: {note.reason}", file=sys.stderr)
        else:
            print(f"kvrag: warning: skipping {note.path}: {note.reason}", file=sys.stderr)
            skipped.append(f"{note.path}: {note.reason}")
    return list(dict.fromkeys(files)), skipped


def _blank(path: Path) -> bool:
    from kvrag.ingest.documents import is_blank

    try:
        return is_blank(path)
    except OSError:
        return False  # _ingest_chunks reports a file that cannot be read


def _file_problem(path: Path) -> str | None:
    """Why `path` cannot be ingested (not text, a bad .jsonl row, unreadable), naming it; None if it can."""
    from kvrag.ingest.documents import check_document

    try:
        check_document(path)
    except ValueError as exc:  # NotTextError too: the message names the file (and a .jsonl line)
        return str(exc)
    except OSError as exc:
        return f"{path}: cannot be read ({exc.strerror or exc})"
    return None


class _IngestProgress:
    """One bar per stage of a streamed ingest: chunks read, KV stored, chunks indexed (on stderr).

    The number of chunks is known only once every file is read; until then each bar's total is
    estimated from the share of the files' bytes read so far (so the ETA is about the whole ingest).
    `passes`: KV entries per chunk (2 when a weight-changing link adapter keeps its own).
    """

    def __init__(self, files: Sequence[Path], passes: int = 1, kv_label: str = "KV stored") -> None:
        self.total_bytes = 0
        for f in files:
            try:
                self.total_bytes += f.stat().st_size
            except OSError:
                pass
        self.bytes = 0
        self.chunks = 0
        self.passes = passes
        self.read = tqdm(desc="chunks read", unit="chunk", position=0, file=sys.stderr)
        self.kv = tqdm(desc=kv_label, unit="chunk", position=1, file=sys.stderr)
        self.indexed = tqdm(desc="indexed", unit="chunk", position=2, file=sys.stderr)

    def on_bytes(self, n: int) -> None:
        self.bytes += n

    def on_chunk(self) -> None:
        self.chunks += 1
        self.read.update(1)

    def estimate(self, final: bool = False) -> None:
        if final or self.bytes >= self.total_bytes:
            total = self.chunks
        elif self.bytes:
            total = max(self.chunks, round(self.chunks * self.total_bytes / self.bytes))
        else:
            return
        for bar, per_chunk in ((self.read, 1), (self.kv, self.passes), (self.indexed, 1)):
            bar.total = total * per_chunk
            bar.refresh()

    def write(self, message: str) -> None:
        tqdm.write(message, file=sys.stderr)

    def close(self) -> None:
        for bar in (self.read, self.kv, self.indexed):
            bar.close()


def _ingest_chunks(files: Sequence[Path], args: argparse.Namespace, tokenizer: Any, progress: _IngestProgress, skipped: list[str]) -> Iterator[Chunk]:
    """Chunks of every file, as they are read, each id once. A file that turns bad while it is read
    (changed since it was checked) is reported and the rest of it skipped."""
    from kvrag.ingest.documents import iter_file_chunks

    seen: set[str] = set()
    for f in files:
        try:
            for chunk in iter_file_chunks(f, args.max_words, args.max_tokens, tokenizer, check=False, on_bytes=progress.on_bytes):
                if chunk.id not in seen:
                    seen.add(chunk.id)
                    progress.on_chunk()
                    yield chunk
        except (ValueError, OSError) as exc:
            progress.write(f"kvrag: warning: skipping the rest of {f}: {exc}")
            skipped.append(f"the rest of {_why(f, str(exc))}")
    progress.estimate(final=True)


def _batches(items: Iterable[Chunk], size: int) -> Iterator[list[Chunk]]:
    it = iter(items)
    while batch := list(itertools.islice(it, size)):
        yield batch


def _each_batch(progress: _IngestProgress, chunks: Iterable[Chunk], step: Callable[[list[Chunk]], tuple[int, bool]]) -> int | None:
    """Run `step` (store a batch's KV, then index what was stored: (chunks indexed, whether to go on))
    on each INGEST_BATCH chunks; returns the chunks indexed, or None when interrupted (Ctrl-C: what
    was stored and indexed is kept, and said so). Any other error is raised after saying the same."""
    indexed = 0
    try:
        for batch in _batches(chunks, INGEST_BATCH):
            kept, go_on = step(batch)
            indexed += kept
            progress.indexed.update(kept)
            progress.estimate()
            if not go_on:
                break
    except KeyboardInterrupt:
        progress.close()
        print(f"kvrag: interrupted: {indexed} chunks are stored and indexed (kept); run the same command again to "
              "complete the rest", file=sys.stderr)
        return None
    except BaseException:
        progress.close()
        print(f"kvrag: {indexed} chunks were stored and indexed before the error (kept)", file=sys.stderr)
        raise
    progress.close()
    return indexed


def _ingest_locally(args: argparse.Namespace, files: list[Path], skipped: list[str], open_engine: Callable[[], tuple[Any, Any]]) -> int:
    from kvrag.kv.repository import PrecomputeReport

    if args.store is None:  # ingest writes to the disk only: a memory tier in front would fill with what this process never reads
        from kvrag.cache_backends import default_disk_url

        args.store = default_disk_url(kvrag_home() / "kv")
    rag, index = open_engine()
    t0 = time.perf_counter()
    total, not_stored, stopped = PrecomputeReport(), [], []
    progress = _IngestProgress(files, passes=2 if getattr(rag, "adapter_lm", None) is not None else 1)

    def step(batch: list[Chunk]) -> tuple[int, bool]:
        report = rag.precompute(batch, batch_size=args.batch_size, progress=progress.kv)
        for field in ("chunks", "computed", "already_cached", "tokens"):
            setattr(total, field, getattr(total, field) + getattr(report, field))
        missed = set(report.not_stored)
        not_stored.extend(report.not_stored)
        kept = [c for c in batch if c.id not in missed]
        index.add(kept, skip_unchanged=True)  # only chunks whose KV is stored: never an index entry without its KV
        if report.computed and len(missed) == report.computed:  # the store kept nothing: it is down
            stopped.append("the store kept none of the last batch's KV, so the ingest stopped")
        return len(kept), not stopped

    if _each_batch(progress, _ingest_chunks(files, args, rag.lm.tokenizer, progress, skipped), step) is None:
        return EXIT_INTERRUPTED
    if not total.chunks:
        print("no text found in the given paths", file=sys.stderr)
        return 1
    if not_stored:  # the failure first and alone: never an "ingested N chunks" line above it
        print(
            f"kvrag: error: stored and indexed {total.chunks - len(not_stored)} of {total.chunks} chunks: "
            f"the KV of {len(not_stored)} of {total.computed} computed chunks was not stored "
            f"(is the store at {rag.store.url} reachable?){''.join('; ' + s for s in stopped)}. They are not indexed: "
            f"run the same command again to complete. First ids: {', '.join(not_stored[:5])}",
            file=sys.stderr,
        )
        return 1
    print(
        f"ingested {total.chunks} chunks ({total.computed} computed, {total.already_cached} already cached, "
        f"{total.tokens} tokens) in {time.perf_counter() - t0:.1f}s; store {rag.store.url}",
        file=sys.stderr,
    )
    print(kv_use_note(rag, total.tokens / max(1, total.chunks)), file=sys.stderr)
    return 0


def kv_use_note(rag: Any, chunk_tokens: float) -> str:
    """When the KV just stored will be read: a question whose chunks hold no more than the read-whole limit is
    read whole (Full Attention), and a default of Full Attention reads every question whole; said at ingest,
    so nobody stores KV that no default question reads without knowing it."""
    from kvrag.options import AnswerOptions

    limit = AnswerOptions().full_context_tokens()
    per = max(1, round(chunk_tokens))
    upto = limit // per
    known = rag.peek_default() if hasattr(rag, "peek_default") else None
    where = (f"a question over at most {limit} chunk tokens is read whole (--short-context/--min-recompute): with "
             f"~{per} tokens a chunk, {upto} chunk(s) or fewer; the stored KV is read from {upto + 1} retrieved chunks on "
             f"(`kvrag ask -k {upto + 1}`)" if limit else "every question reads the stored KV (the read-whole limit is off)")
    if known is not None and known.method == "full":
        return (f"kvrag: note: the default here is Full Attention ({known.label()}): questions that name no method read "
                f"their chunks whole, never this KV; a reuse method (--method) reads it where {where}")
    default = known.label() if known is not None else "not calibrated yet"
    return f"kvrag: note: when the stored KV is read (the default: {default}): {where}"


def _ingest_via_server(args: argparse.Namespace, files: list[Path], skipped: list[str], open_index: Callable[[], Any]) -> int:
    """Each batch posted to the server, which stores its KV and, when it retrieves, indexes it (the answer's
    `indexed`): the shared index is written once, by the server. A server that does not retrieve answers
    no `indexed`; the batch is then indexed here (`open_index()`, opened only then), as `kvrag ask
    --server` retrieves from this machine's index for such a server."""
    from kvrag import client
    from kvrag.ingest.retrieval import named_source

    roots = [str(p) for p in args.paths]
    local: list[Any] = []  # this machine's index, once a batch needs it
    progress = _IngestProgress(files, kv_label="KV on server")
    total = {"chunks": 0, "computed": 0, "already_cached": 0, "tokens": 0, "seconds": 0.0}
    counts = {"server": 0, "here": 0}  # chunks new or changed in the server's index; chunks indexed here

    def step(batch: list[Chunk]) -> tuple[int, bool]:
        # ServerError when the server's store did not keep some KV: the batch is then indexed nowhere
        report = client.ingest_via_server(args.server, [named_source(c, roots) for c in batch])
        for k in total:
            total[k] += report.get(k, 0)
        progress.kv.update(len(batch))
        if "indexed" in report:  # the server indexed what it stored
            counts["server"] += report["indexed"]
        else:
            if not local:
                local.append(open_index())
            local[0].add(batch, skip_unchanged=True)
            counts["here"] += len(batch)
        return len(batch), True

    if _each_batch(progress, _ingest_chunks(files, args, None, progress, skipped), step) is None:
        return EXIT_INTERRUPTED
    if not total["chunks"]:
        print("no text found in the given paths", file=sys.stderr)
        return 1
    print(f"ingested {total['chunks']} chunks ({total['computed']} computed, {total['already_cached']} already cached, "
          f"{total['tokens']} tokens) in {total['seconds']:.1f}s on {args.server}; {_indexed_line(counts)}", file=sys.stderr)
    return 0


def _indexed_line(counts: dict[str, int]) -> str:
    """Where the chunks were indexed: by the server (its `indexed`: entries new or changed), or here."""
    parts = []
    if counts["server"] or not counts["here"]:
        parts.append(f"{counts['server']} new or changed in the server's index")
    if counts["here"]:
        parts.append(f"{counts['here']} indexed on this machine (the server does not retrieve)")
    return "; ".join(parts)


def register(sub: argparse._SubParsersAction) -> None:
    ing = sub.add_parser("ingest", help="split files into chunks, index them and precompute their KV")
    add_engine_options(ing)
    add_server_option(ing)
    ing.add_argument("paths", nargs="+", help=".txt/.md/.jsonl files or folders")
    ing.add_argument("--max-words", type=int, default=120, help="target chunk size in words (default 120)")
    ing.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_CHUNK_TOKENS,
                     help=f"hard cap on a chunk's tokens (default {DEFAULT_MAX_CHUNK_TOKENS})")
    ing.add_argument("--batch-size", type=positive_int, default=8, help="chunks per forward pass (default 8)")
    ing.add_argument("--follow-symlinks", action="store_true",
                     help="in folders, follow symlinks that lead out of the folder (default: skipped and named; "
                          "a file named on the command line is always read)")

    rm = sub.add_parser("remove", help="remove ingested documents: their chunks from the index and their KV from the store",
                        epilog="example: kvrag remove notes.md")
    _add_remove_options(rm)
    rm.add_argument("paths", nargs="+", help="files given to `kvrag ingest` (as they were given)")
    ing.set_defaults(func=cmd_ingest)
    rm.set_defaults(func=cmd_remove)


def _add_remove_options(rm: argparse.ArgumentParser) -> None:
    """The engine options that say where a document is (store, model, device, index), not those of answering
    (--decode-weights, --link-adapter): removing reads no weights, and the link adapter is the default one."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_options(probe)  # the same options, helps and defaults as every other command
    for action in probe._actions:
        if action.dest in ("decode_weights", "link_adapter"):
            continue
        kw = {"default": action.default, "help": action.help, "metavar": action.metavar, "type": action.type, "choices": action.choices}
        rm.add_argument(*action.option_strings, **{k: v for k, v in kw.items() if v is not None})
    rm.set_defaults(decode_weights=None, link_adapter="auto")


def cmd_ingest(args: argparse.Namespace) -> int:
    """Check every file before any model loads, then chunk, store and index in streamed batches."""
    return run_ingest(args, lambda: common.open_engine(args), lambda: common.open_index(args))


def cmd_remove(args: argparse.Namespace) -> int:
    """Every document's chunks out of the index, their ids out of the store's id index and their KV
    deleted; refused whole, before anything changes, while the store's id index cannot be read (the
    ids would stay bound there, and other processes sharing the store would still answer them)."""
    rag, index = common.open_engine(args)
    try:  # before the index changes: the whole removal, or none of it
        rag.check_links_readable([c.id for path in args.paths for c in index.by_source(str(path))])
    except StoreUnavailableError:
        print("kvrag remove: the KV store's id index cannot be read (is its Redis down?): nothing was removed; "
              "run it again once the store is back", file=sys.stderr)
        return 1
    removed = 0
    for path in args.paths:
        gone = index.remove(source=str(path))
        deleted = rag.forget(gone)
        removed += len(gone)
        if gone:  # what was removed, on stdout: the command's result
            ids = ", ".join(c.id for c in gone[:5]) + (f" and {len(gone) - 5} more" if len(gone) > 5 else "")
            print(f"removed {path}: {len(gone)} chunks removed from the index ({ids}), {deleted} KV entries deleted "
                  f"from {rag.store.url}")
        else:
            print(f"kvrag: {path}: not in the index, nothing removed (give the path as it was given to `kvrag ingest`)",
                  file=sys.stderr)
    return 0 if removed else 1
