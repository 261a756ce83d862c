"""Turn two through the frameworks' own conversation paths, against the model's own chat template over the same
retrieved documents (issue #61).

    python scripts/framework_turns.py --out docs/bench/layout [--conversations N] [--layout v1]

The two-turn conversations of `kvrag eval layout` (kvrag/eval/layout_conversations.json; follow-ups that say
"it", "they", "there"), their 16 documents in one index, answered by:
- LlamaIndex `condense_plus_context` and `context` chat engines over `KVRagLLM` + `KVCacheNodePostprocessor`;
- a LangChain history chain (system context + history + question, retrieval with the recent user turns) over
  `ChatKVRag`;
- `kvrag serve` (its app on loopback, retrieving from its own index, top 3) asked by the `openai` package;
each with the engine's default method and layout (or `--layout`). For every turn two, the reference is the model's
own chat template (`tokenizer.apply_chat_template`, Full Attention) over the documents that path retrieved for it,
in a system message, after the same turn one. Also recorded: whether turn two's retrieval found the conversation's
document (a condense step that loses the follow-up shows there). Writes OUT/frameworks.json and OUT/frameworks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from kvrag.eval.layout_eval import load_conversations
from kvrag.eval.metrics import contains

K = 3  # documents a turn retrieves


def _reference(rag: Any, texts: list[str], q1: str, a1: str, q2: str, max_new_tokens: int) -> str:
    """The model's own chat template over these documents in a system message, after the same turn one."""
    messages = [("system", "\n\n".join(texts)), ("user", q1), ("assistant", a1), ("user", q2)]
    return rag.chat(messages, max_new_tokens=max_new_tokens, prefix_cache=False).text  # no chunks: the template as it is


def llama_index_paths(rag: Any, docs: dict[str, str], max_new_tokens: int) -> dict[str, Callable[[str, str], dict[str, Any]]]:
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter

    from kvrag.integrations.llama_index import KVCacheNodePostprocessor, KVRagLLM, MiniLMEmbedding

    index = VectorStoreIndex.from_documents([Document(text=t, id_=k) for k, t in docs.items()], embed_model=MiniLMEmbedding(),
                                            transformations=[SentenceSplitter(chunk_size=512)])
    llm = KVRagLLM(rag=rag, max_new_tokens=max_new_tokens)

    class Recording(KVCacheNodePostprocessor):
        """The framework's retrieval as it happened: the query it retrieved with and the documents found."""

        def _postprocess_nodes(self, nodes, query_bundle=None):  # type: ignore[no-untyped-def]
            seen.append((query_bundle.query_str if query_bundle else "", [n.node.ref_doc_id for n in nodes], [n.node.get_content() for n in nodes]))
            return super()._postprocess_nodes(nodes, query_bundle)

    seen: list[tuple[str, list[str], list[str]]] = []

    def path(mode: str) -> Callable[[str, str], dict[str, Any]]:
        def run(q1: str, q2: str) -> dict[str, Any]:
            seen.clear()
            engine = index.as_chat_engine(chat_mode=mode, llm=llm, node_postprocessors=[Recording(llm)], similarity_top_k=K)
            one = str(engine.chat(q1)).strip()
            two = str(engine.chat(q2)).strip()
            query, ids, texts = seen[-1]
            return {"turn1": one, "turn2": two, "query2": query, "ids2": ids, "texts2": texts, "path2": llm.last_stats.path}
        return run

    return {"LlamaIndex condense_plus_context": path("condense_plus_context"), "LlamaIndex context": path("context")}


def langchain_path(rag: Any, docs: dict[str, str], index_dir: Path, max_new_tokens: int) -> Callable[[str, str], dict[str, Any]]:
    from langchain_core.chat_history import InMemoryChatMessageHistory
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.runnables.history import RunnableWithMessageHistory

    from kvrag.ingest.retrieval import ChunkIndex
    from kvrag.integrations.langchain import ChatKVRag, ChunkIndexRetriever
    from kvrag.types import Chunk

    index = ChunkIndex(index_dir, collection="framework_turns")
    index.add([Chunk(id=k, text=t) for k, t in docs.items()])
    retriever = ChunkIndexRetriever(index, k=K)
    prompt = ChatPromptTemplate.from_messages([("system", "Answer from this context:\n\n{context}"), MessagesPlaceholder("history"),
                                               ("human", "{question}")])
    llm = ChatKVRag(rag=rag, max_new_tokens=max_new_tokens)
    seen: list[tuple[str, list[str], list[str]]] = []

    def context(x: dict) -> str:
        recent = " ".join([m.content for m in x["history"] if m.type == "human"][-1:] + [x["question"]])
        found = retriever.invoke(recent)
        seen.append((recent, [d.id for d in found], [d.page_content for d in found]))
        return "\n\n".join(d.page_content for d in found)

    chain = RunnablePassthrough.assign(context=context) | prompt | llm

    def run(q1: str, q2: str) -> dict[str, Any]:
        store: dict[str, InMemoryChatMessageHistory] = {}
        with_history = RunnableWithMessageHistory(chain, lambda sid: store.setdefault(sid, InMemoryChatMessageHistory()),
                                                  input_messages_key="question", history_messages_key="history")
        cfg = {"configurable": {"session_id": "s"}}
        one = with_history.invoke({"question": q1}, config=cfg)
        two = with_history.invoke({"question": q2}, config=cfg)
        query, ids, texts = seen[-1]
        return {"turn1": one.content.strip(), "turn2": two.content.strip(), "query2": query, "ids2": ids, "texts2": texts,
                "path2": two.response_metadata["stats"]["path"]}

    return run


class Documents:
    """What a path's index holds for the conversation at hand: every document, or only the conversation's own
    three (as the layout eval gives them: its document among two others)."""

    def __init__(self, index: Any, docs: dict[str, str]) -> None:
        self.index, self.docs, self.held = index, docs, list(docs)

    def only(self, chunks: list[Any]) -> None:
        self.index.remove(ids=self.held)
        self.index.add(chunks)
        self.held = [c.id for c in chunks]


def server_path(rag: Any, docs: dict[str, str], index_dir: Path, max_new_tokens: int,
                holder: list[Documents] | None = None) -> Callable[[str, str], dict[str, Any]]:
    """`kvrag serve`'s app (uvicorn on loopback, in this process) retrieving from its own index, asked by the
    `openai` package as a client would: turn one, then turn two after it. `holder` receives the index's
    `Documents`, so the caller can narrow it per conversation."""
    import threading

    import openai
    import uvicorn

    from kvrag.ingest.retrieval import ChunkIndex
    from kvrag.server import ServerSettings, create_app
    from kvrag.types import Chunk

    index = ChunkIndex(index_dir, collection="framework_turns_server")
    index.add([Chunk(id=k, text=t) for k, t in docs.items()])
    if holder is not None:
        holder.append(Documents(index, docs))
    server = uvicorn.Server(uvicorn.Config(create_app(rag, ServerSettings(), index), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    extra = {"kvrag": {"top_k": K}}

    def run(q1: str, q2: str) -> dict[str, Any]:
        m = [{"role": "user", "content": q1}]
        one = client.chat.completions.create(model="kvrag", messages=m, max_tokens=max_new_tokens, extra_body=extra)
        m += [{"role": "assistant", "content": one.choices[0].message.content}, {"role": "user", "content": q2}]
        two = client.chat.completions.create(model="kvrag", messages=m, max_tokens=max_new_tokens, extra_body=extra)
        ids = [s["id"] for s in two.model_extra["kvrag_sources"]]
        return {"turn1": one.choices[0].message.content.strip(), "turn2": two.choices[0].message.content.strip(), "query2": q2,
                "ids2": ids, "texts2": [docs[i] for i in ids], "path2": "kvrag serve"}

    return run


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name in dict.fromkeys(r["framework"] for r in records):
        rs = [r for r in records if r["framework"] == name]
        n = len(rs)
        rows.append({"framework": name, "n": n, "turn1": sum(r["contained1"] for r in rs), "turn2": sum(r["contained2"] for r in rs),
                     "template_turn2": sum(r["template2"] for r in rs), "gold_retrieved2": sum(r["gold_retrieved2"] for r in rs),
                     "within_one_in_30": sum(r["contained2"] for r in rs) / n >= sum(r["template2"] for r in rs) / n - 1 / 30 - 1e-9})
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# Turn two through the frameworks, against the model's own chat template over the same documents", "",
             f"`{meta['command']}`", "",
             f"Machine: {meta['machine']}; bundled SmolLM2-135M-Instruct, greedy, {meta['max_new_tokens']} new tokens at most; "
             f"{meta['n']} two-turn conversations of `kvrag eval layout` over {meta.get('documents', 'their 16 documents in one index')}, top {K}; the engine's "
             f"default method, layout `{meta['layout']}`. \"template\" = the model's own chat template over the documents that path "
             "retrieved for turn two, in a system message, after the same turn one (Full Attention). \"gold retrieved\" = turn two's "
             "retrieval found the conversation's document.", "",
             "| path | turn 1 contained | turn 2 contained | template, same documents: turn 2 | within one in 30 | turn 2 gold retrieved |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        n = r["n"]
        lines.append(f"| {r['framework']} | {r['turn1']}/{n} | **{r['turn2']}/{n}** | {r['template_turn2']}/{n} | "
                     f"{'yes' if r['within_one_in_30'] else 'no'} | {r['gold_retrieved2']}/{n} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--conversations", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--layout", default=None, help="a layout preset, JSON or file (default: the engine's default)")
    p.add_argument("--paths", default=None, help="comma-separated path names to run (default: all); 'server' = kvrag serve")
    p.add_argument("--own-documents", action="store_true",
                   help="the server's index holds only the conversation's own three documents (its retrieval returns all three)")
    args = p.parse_args(argv)

    from kvrag import KVRag
    from kvrag.eval.runner import hardware
    from kvrag.eval.report import hardware_line

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rag = KVRag.from_pretrained(store="memory://", check=False, layout=args.layout)
    spec = json.loads((Path(__file__).resolve().parents[1] / "kvrag" / "eval" / "layout_conversations.json").read_text(encoding="utf-8"))
    docs = {f"layout-doc-{k}": v for k, v in spec["documents"].items()}
    gold_of = {c["id"]: f"layout-doc-{c['doc']}" for c in spec["conversations"]}
    cases = load_conversations()[: args.conversations]
    records = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="kvrag-frameworks-") as tmp:
        holder: list[Documents] = []
        server = "kvrag serve, openai client" + (" (its three documents)" if args.own_documents else "")
        wanted = set(args.paths.split(",")) if args.paths else None
        paths: dict[str, Callable[[str, str], dict[str, Any]]] = {}
        if wanted is None or "server" in wanted:
            paths[server] = server_path(rag, docs, Path(tmp) / "server-chroma", args.max_new_tokens, holder)
        if wanted is None or wanted & {"llama_index", "langchain"}:
            paths.update(llama_index_paths(rag, docs, args.max_new_tokens))
            paths["LangChain history chain"] = langchain_path(rag, docs, Path(tmp) / "chroma", args.max_new_tokens)
        for case in cases:
            if args.own_documents and holder:
                holder[0].only(case.chunks)
            (q1, gold1), (q2, gold2) = case.turns
            for name, run in paths.items():
                got = run(q1, q2)
                ref = _reference(rag, got["texts2"], q1, got["turn1"], q2, args.max_new_tokens)
                records.append({"framework": name, "case": case.id, **{k: v for k, v in got.items() if k != "texts2"}, "template2_text": ref,
                                "contained1": contains(got["turn1"], gold1) > 0, "contained2": contains(got["turn2"], gold2) > 0,
                                "template2": contains(ref, gold2) > 0, "gold_retrieved2": gold_of[case.id] in got["ids2"]})
            print(f"{case.id}: " + ", ".join(f"{r['framework']} {int(r['contained2'])}/{int(r['template2'])}" for r in records[-len(paths):]),
                  file=sys.stderr, flush=True)
    rows = summarise(records)
    meta = {"command": "python scripts/framework_turns.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": hardware_line(hardware()), "max_new_tokens": args.max_new_tokens, "n": len(cases),
            "layout": args.layout or "default",
            "documents": "each conversation's own three documents in the server's index, every other path's index holding all 16"
            if args.own_documents else "their 16 documents in one index", "layout_options": rag.layout.options.describe(), "seconds": time.time() - t0}
    (out / "frameworks.json").write_text(json.dumps({"meta": meta, "summary": rows, "records": records}, indent=1), encoding="utf-8")
    (out / "frameworks.md").write_text(markdown(rows, meta), encoding="utf-8")
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
