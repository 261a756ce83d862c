"""`kvrag serve`: the parser and the command (wired into `kvrag.cli.app` by `add_serve_parser`)."""

from __future__ import annotations

import argparse
import os

from kvrag.cli.args import DECODE_WEIGHTS_HELP, HelpFormatter, link_adapter_arg, ratio_or_auto
from kvrag.cli.common import add_index_option
from kvrag.defaults import DECODE_WEIGHTS, DEFAULT_DISK_PRECISION, DEFAULT_METHOD, TUNED_METHOD
from kvrag.server.settings import ServerSettings

EPILOG = """examples:
  kvrag serve --store redis://127.0.0.1:6379/0 --max-queue 32
  # replicas: one Redis + one `chroma run --path DIR --port 8000` + N of these (keys from the environment)
  KVRAG_API_KEYS=sk-admin KVRAG_READ_KEYS=sk-app kvrag serve --host 0.0.0.0 \\
    --store redis://10.0.0.5:6379/0 --index chroma://10.0.0.5:8000/kvrag_chunks
  curl http://127.0.0.1:8600/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "kvrag", "messages": [{"role": "user", "content": "When did the Brannoch Line open?"}]}'
  curl http://127.0.0.1:8600/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "kvrag", "messages": [{"role": "user", "content": "When did the Brannoch Line open?"}],
         "kvrag": {"chunk_ids": ["doc-1", "doc-7"], "method": "a3", "recompute_ratio": 0.15}}'
"""


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `serve` to the `kvrag` command's subparsers."""
    d = ServerSettings()
    p = subparsers.add_parser(
        "serve",
        help="one warm process (model + KV store) answering over HTTP: OpenAI-compatible chat, ingest, metrics",
        description="Serve kvrag over HTTP. Loopback only unless --host is given; no authentication unless keys are "
                    "given (--api-key, --read-key).",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--host", default=argparse.SUPPRESS,
                   help=f"interface to bind (default: {d.host}, this machine only); any other is reachable by others: give API keys")
    p.add_argument("--port", type=int, default=d.port, help="TCP port")
    p.add_argument("--store", default=os.environ.get("KVRAG_STORE"), help=f"KV store URL (default: memory in front of disk under $KVRAG_HOME/kv, quantize={DEFAULT_DISK_PRECISION}); redis://... to share it between replicas")
    p.add_argument("--model", default=os.environ.get("KVRAG_MODEL"), help="HF model id, folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=d.device, help="auto (CUDA when present), cuda or cpu")
    p.add_argument("--max-concurrency", type=int, default=d.max_concurrency, help="requests running on the engine at once")
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="requests waiting for a slot; more get 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="request body limit (413 above)")
    p.add_argument("--max-chunks", type=int, default=d.max_chunks, help="chunks per request (413 above)")
    p.add_argument("--max-request-tokens", type=int, default=d.max_request_tokens, help="tokens of text per request (413 above)")
    p.add_argument("--link-adapter", default=d.link_adapter, type=link_adapter_arg,
                   help="auto/links: the shipped link embeddings (base weights); tuned: the shipped LoRA on kvlink's fast path; none; or a file")
    p.add_argument("--method", default=d.method, help="method when a request names none (see `kvrag methods`; default: the engine's, "
                                                      f"{TUNED_METHOD} over a tuned model, else the model's calibrated setting, "
                                                      f"{DEFAULT_METHOD} with calibration off)")
    p.add_argument("--recompute-ratio", type=ratio_or_auto, default=d.recompute_ratio, help="recompute ratio when a request gives none")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="max_tokens when a request gives none")
    p.add_argument("--decode-weights", choices=DECODE_WEIGHTS, default=d.decode_weights, help=DECODE_WEIGHTS_HELP)
    p.add_argument("--no-retrieval", dest="retrieval", action="store_false", default=d.retrieval,
                   help="answer chat requests that bring no kvrag context as plain chat (default: from the top-k chunks of "
                        "the index `kvrag ingest` fills, named in the response's kvrag_sources)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="chunks retrieved for a request that brings none")
    p.add_argument("--collection", default=d.collection, help="chroma collection to retrieve from (under $KVRAG_HOME/chroma, or on --index)")
    p.add_argument("--cite-sources", action="store_true", default=d.cite_sources,
                   help='end each answer the server retrieved for with "Sources: [1] <title> (<file>)", for OpenAI clients '
                        "that show only the text (LangChain's ChatOpenAI drops kvrag_sources); a request's "
                        '"kvrag": {"cite": true|false} overrides it (default: off: answers are what the model said)')
    p.add_argument("--layout", default=os.environ.get("KVRAG_LAYOUT") or d.layout, metavar="JSON|FILE|PRESET",
                   help='the prompt layout, one object: a preset (default, chat, v1), JSON text such as \'{"place": "system", '
                        '"instruction": "", "chunk_template": "{title}\\n{text}\\n", "question_template": "{question}"}\' '
                        "(keys: place system/user/turn, instruction, chunk_template with {text}, untitled_chunk_template, "
                        "question_template with {question}, documents_end, history after/before), or a JSON file of it "
                        "(default: $KVRAG_LAYOUT, else the default layout); checked at start")
    add_index_option(p)
    p.add_argument("--api-key", dest="api_keys", action="append", default=None, metavar="KEY",
                   help="a key that may read and write (chat, models, metrics; POST/DELETE /v1/chunks), sent as "
                        "`Authorization: Bearer KEY`; repeatable (default: $KVRAG_API_KEYS, comma-separated). With any key, "
                        "every route but /health needs one. Prefer the variable: a command line is visible to `ps`")
    p.add_argument("--read-key", dest="read_keys", action="append", default=None, metavar="KEY",
                   help="a key that may only read (chat, models, metrics: 403 on POST/DELETE /v1/chunks); repeatable "
                        "(default: $KVRAG_READ_KEYS, comma-separated)")
    p.add_argument("--prefix-cache-mb", type=int, default=d.prefix_cache_mb,
                   help="MB of finished turns' KV kept in memory so a conversation's next turn reads only its new tokens "
                        "(0: off; default: $KVRAG_PREFIX_CACHE_MB, else 1024)")
    p.add_argument("--allow-no-auth", action="store_true", default=d.allow_no_auth,
                   help="serve a --host other than loopback without any API key (refused by default: anyone who reaches "
                        "it could read and change your chunks)")
    p.add_argument("--share-prefix-cache", action="store_true", default=d.share_prefix_cache,
                   help="let every API key read what the others left cached (prefix cache, inline chunks' KV): for one trusted "
                        "tenant with several keys (default: each key is its own tenant; see docs/server.md, Tenants)")
    p.add_argument("--retrieval-turns", type=int, default=d.retrieval_turns,
                   help="user turns a follow-up retrieves with: its own and the ones before it (1: the last message alone)")
    p.add_argument("--accept-any-model", action="store_true", default=d.accept_any_model,
                   help='answer whatever `model` a chat request names (default: only the served model or "kvrag"; others get 404 model_not_found)')
    p.set_defaults(func=cmd_serve)
    return p


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        host=getattr(args, "host", None) or ServerSettings.host,
        port=args.port,
        store=args.store,
        model=args.model,
        device=args.device,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        max_chunks=args.max_chunks,
        max_request_tokens=args.max_request_tokens,
        link_adapter=args.link_adapter,
        method=args.method,
        recompute_ratio=args.recompute_ratio,
        max_new_tokens=args.max_new_tokens,
        accept_any_model=args.accept_any_model,
        decode_weights=args.decode_weights,
        retrieval=args.retrieval,
        top_k=args.top_k,
        prefix_cache_mb=args.prefix_cache_mb,
        retrieval_turns=args.retrieval_turns,
        cite_sources=args.cite_sources,
        collection=args.collection,
        layout=args.layout,
        index=getattr(args, "index", None),
        api_keys=_keys(args.api_keys, "KVRAG_API_KEYS"),
        read_keys=_keys(args.read_keys, "KVRAG_READ_KEYS"),
        share_prefix_cache=args.share_prefix_cache,
        allow_no_auth=args.allow_no_auth,
    )


def _keys(given: list[str] | None, variable: str) -> tuple[str, ...]:
    """Keys from the command line, else from `variable` (comma-separated; blanks between keys ignored).
    A variable that holds something but no key (`" , "`) is an error: it was meant to turn keys on."""
    if given is not None:
        return tuple(k.strip() for k in given)
    raw = os.environ.get(variable, "")
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    if raw.strip() and not keys:
        raise ValueError(f"${variable} is set ({raw!r}) but holds no key: give comma-separated keys, or unset it")
    return keys


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server until Ctrl-C (blocks)."""
    from kvrag.server.runner import serve

    serve(settings_from_args(args))
    return 0
