"""What several commands share: the engine's options, opening the engine and the chunk index, retrieval."""

from __future__ import annotations

import argparse
import os
import sys

from kvrag.cli.args import DECODE_WEIGHTS_HELP, link_adapter_arg
from kvrag.defaults import DECODE_WEIGHTS, DEFAULT_DISK_PRECISION
from kvrag.errors import KVRagError

DEFAULT_K = 5  # chunks retrieved per question


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """--store, --model, --device, --collection, --link-adapter: which engine and index a command opens."""
    p.add_argument("--store", default=os.environ.get("KVRAG_STORE"), help=f"KV store URL (default: memory in front of disk under $KVRAG_HOME/kv, quantize={DEFAULT_DISK_PRECISION})")
    p.add_argument("--model", default=os.environ.get("KVRAG_MODEL"), help="HF model id, folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cuda or cpu")
    p.add_argument("--collection", default="kvrag_chunks", help="chroma collection (under $KVRAG_HOME/chroma, or on --index)")
    add_index_option(p)
    p.add_argument("--decode-weights", choices=DECODE_WEIGHTS, default=None, help=DECODE_WEIGHTS_HELP)
    p.add_argument("--link-adapter", default="auto", type=link_adapter_arg,
                   help="auto/links: the link embeddings shipped for the model (base weights); tuned: the shipped "
                        "reuse-tuned LoRA on kvlink's fast path (kvlink by default; Full Attention stays the base "
                        "weights); none: no adapter; or an adapter file")


def add_index_option(p: argparse.ArgumentParser) -> None:
    """--index: the retrieval index, when it is not this machine's embedded one."""
    p.add_argument("--index", default=os.environ.get("KVRAG_INDEX") or None, metavar="URL",
                   help="a shared retrieval index, chroma://host:port/collection (a `chroma run` server every replica "
                        "and ingest uses; default: $KVRAG_INDEX, else the embedded one under $KVRAG_HOME/chroma)")


def add_server_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=os.environ.get("KVRAG_SERVER"),
                   help="URL of a running `kvrag serve` (default: $KVRAG_SERVER): no model is loaded here")


NOTHING_INGESTED = "nothing has been ingested yet: run `kvrag ingest PATH...` first"


def index_size(args: argparse.Namespace) -> int:
    """Chunks in the index (this machine's $KVRAG_HOME/chroma, or --index; --collection), counted
    without loading a model."""
    from kvrag.defaults import kvrag_home
    from kvrag.ingest.retrieval import indexed_count

    if getattr(args, "index", None):
        return indexed_count(None, args.collection, url=args.index)
    return indexed_count(kvrag_home() / "chroma", args.collection)


def require_index(args: argparse.Namespace) -> None:
    """Fail at once when the index is empty, before a model is loaded or converted (seconds, or a
    517 MB write on a first run) only to find nothing to answer from."""
    from kvrag.defaults import kvrag_home

    if index_size(args) == 0:
        where = args.index if getattr(args, "index", None) else kvrag_home() / "chroma"
        raise KVRagError(f"{NOTHING_INGESTED} (the index {where} is empty)")


def open_engine(args: argparse.Namespace):
    from kvrag.engine import KVRag

    print(f"loading model ({args.model or 'bundled SmolLM2-135M-Instruct'}) ...", file=sys.stderr)
    rag = KVRag.from_pretrained(args.model, store=args.store, device=args.device, link_adapter=args.link_adapter,
                                decode_weights=getattr(args, "decode_weights", None))
    index = open_index(args)
    rag.recover_from(index)  # a chunk whose KV entry is damaged is recomputed from this index's text
    return rag, index


def open_index(args: argparse.Namespace):
    """The index a command reads and writes: --index (shared) or $KVRAG_HOME/chroma. Chunks an ingest
    adds record their file's name relative to the paths it was given (what clients are shown)."""
    from kvrag.defaults import kvrag_home
    from kvrag.ingest.retrieval import ChunkIndex

    roots = [str(p) for p in getattr(args, "paths", None) or ()]
    if getattr(args, "index", None):
        return ChunkIndex(url=args.index, collection=args.collection, sources_under=roots)
    return ChunkIndex(kvrag_home() / "chroma", collection=args.collection, sources_under=roots)


def retrieve(index, question: str, k: int):
    chunks = index.query(question, k=k)
    if not chunks:
        raise KVRagError(NOTHING_INGESTED)
    return chunks
