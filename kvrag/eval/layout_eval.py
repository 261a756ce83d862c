"""`kvrag eval layout`: which prompt layout (kvrag.kv.layout_options) answers best, measured, not assumed.

Every candidate layout answers the suite's sets (kvrag.eval.suite.SETS) and the two-turn conversations of
`layout_conversations.json` (follow-ups that say "it", "they", "there"), twice: each over its own document
and two others (`conversations`), and each turn over what it retrieves from one index of all the documents
(`conversations-index`, as `kvrag serve` answers them: turn two may find other documents). Each row under Full Attention and
under the training-free reuse default (`calibrate=False`: fusionrag@0.15 with the read-whole policies; a
model's calibration may choose Full Attention, which would judge every layout under Full twice). The model's own chat template (`tokenizer.apply_chat_template` over the
documents in a system message, then the conversation; Full Attention) answers the conversations as the
reference. kvrag.eval.layout_report turns the records into the table and applies the rule.

The candidates are today's layout, the chat-template-like one (documents in the system message, no header,
the question as written), and that one changed one factor at a time: where the documents go, the
instruction, the chunk header and the question template (the full cross product is not run).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Sequence

from kvrag.chat import Conversation
from kvrag.eval.data import Example
from kvrag.eval.metrics import agreement, contains
from kvrag.kv.layout_options import CHAT_LAYOUT, FRAMEWORK_INSTRUCTION, INSTRUCTION_LAYOUT, V1_LAYOUT, LayoutOptions
from kvrag.types import Chunk

TODAY = "v1"
REFERENCE = "template"  # the model's own chat template, documents in a system message (conversations only)
CONVERSATIONS = "conversations"  # each conversation over its own document and two others
CONVERSATIONS_INDEX = "conversations-index"  # the same conversations, each turn retrieving from one index of every document
CONVERSATION_SETS = (CONVERSATIONS, CONVERSATIONS_INDEX)
INDEX_TOP_K = 3  # documents a turn of `conversations-index` retrieves (the server's and the frameworks' usual top 3)
_CHAT = CHAT_LAYOUT  # documents in the system message, no instruction, no header, the question as written
CANDIDATES: dict[str, LayoutOptions] = {
    TODAY: V1_LAYOUT,
    "chat": _CHAT,
    "chat+instruction": INSTRUCTION_LAYOUT,
    "chat+framework": _CHAT.replace(instruction=FRAMEWORK_INSTRUCTION),
    "chat+title": _CHAT.replace(chunk_template="{title}\n{text}\n"),
    "chat+question": _CHAT.replace(question_template="Question: {question}"),
    "chat@turn": _CHAT.replace(place="turn"),
    "chat@turn-late": _CHAT.replace(place="turn", history="before"),
}
DEFAULT_N = 8  # rows a set (the conversations: all of them)
DEFAULT_NEW_TOKENS = 32


@dataclass(frozen=True)
class ConversationCase:
    """A two-turn conversation over its document and two others (or, retrieved, over what each turn found)."""

    id: str
    chunks: list[Chunk]  # turn one's documents
    turns: list[tuple[str, list[str]]]  # (question, gold answers)
    later: list[Chunk] | None = None  # turn two's documents, where it retrieved its own (None: turn one's)

    def chunks_for(self, turn: int) -> list[Chunk]:
        return self.later if turn == 2 and self.later is not None else self.chunks


def load_conversations(seed: int = 0) -> list[ConversationCase]:
    """The bundled set: each conversation's document among two others (seeded order)."""
    spec = json.loads(resources.files("kvrag.eval").joinpath("layout_conversations.json").read_text(encoding="utf-8"))
    docs = {k: Chunk(id=f"layout-doc-{k}", text=v) for k, v in spec["documents"].items()}
    rng = random.Random(seed)
    out = []
    for conv in spec["conversations"]:
        gold = docs[conv["doc"]]
        chunks = [gold, *rng.sample([d for k, d in docs.items() if k != conv["doc"]], 2)]
        rng.shuffle(chunks)
        out.append(ConversationCase(conv["id"], chunks, [(t["q"], list(t["a"])) for t in conv["turns"]]))
    return out


def load_index_conversations(k: int = INDEX_TOP_K) -> list[ConversationCase]:
    """The bundled conversations over one index of all their documents, as `kvrag serve` answers them: turn one
    retrieves the top `k` with its question, turn two with the user turns so far (Conversation.retrieval_query),
    from a ChunkIndex (the server's own retrieval) in a temporary folder."""
    import tempfile

    from kvrag.ingest.retrieval import ChunkIndex

    spec = json.loads(resources.files("kvrag.eval").joinpath("layout_conversations.json").read_text(encoding="utf-8"))
    docs = [Chunk(id=f"layout-doc-{key}", text=text) for key, text in spec["documents"].items()]
    out = []
    with tempfile.TemporaryDirectory() as folder:
        index = ChunkIndex(Path(folder) / "chroma")
        index.add(docs)
        for conv in spec["conversations"]:
            q1, q2 = (t["q"] for t in conv["turns"])
            follow_up = Conversation.ask(q1).with_answer("", q2).retrieval_query()
            out.append(ConversationCase(conv["id"], index.query(q1, k), [(t["q"], list(t["a"])) for t in conv["turns"]],
                                        later=index.query(follow_up, k)))
    return out


def half_of(set_name: str, row_id: str, ids: Sequence[str]) -> str:
    """"choose" or "report": the rows of a set in a hashed order, alternately (half each, whatever the ids)."""
    order = sorted(ids, key=lambda i: hashlib.sha256(f"{set_name}/{i}".encode()).hexdigest())
    return "choose" if order.index(row_id) % 2 == 0 else "report"


def _done(path: Path) -> set[tuple[str, str, str, str, int]]:
    done = set()
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
                done.add((r["set"], r["row"], r["layout"], r["method"], r["turn"]))
            except (ValueError, KeyError):
                continue  # a line cut off by an interruption
    return done


class LayoutRun:
    """Answers rows with one engine per candidate layout (one model, one store: keys hold the layout), writing
    a record per answer as it is made, so a stopped run resumes where it stopped."""

    def __init__(self, lm: Any, layouts: dict[str, LayoutOptions], out: Path, max_new_tokens: int) -> None:
        from kvrag.cache_backends import open_store
        from kvrag.engine import KVRag
        from kvrag.kv.layout import PromptLayout

        store = open_store("memory://?max_bytes=300000000")
        self.engines = {name: KVRag(lm, store=store, layout=PromptLayout(lm.tokenizer, opts), check=False, link_adapter=None,
                              calibrate=False) for name, opts in layouts.items()}
        self.out = out
        self.records = out / "records.jsonl"
        self.done = _done(self.records)
        self.max_new_tokens = max_new_tokens

    def _write(self, record: dict[str, Any]) -> None:
        with self.records.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.done.add((record["set"], record["row"], record["layout"], record["method"], record["turn"]))

    def _todo(self, set_name: str, row: str, layout: str, turn: int) -> bool:
        """Whether this row still needs an answer (the folder read again: another process may share it)."""
        self.done |= _done(self.records)
        return any((set_name, row, layout, m, turn) not in self.done for m in ("full", "default"))

    def answer_row(self, set_name: str, ex: Example, half: str) -> None:
        """One question under every layout: Full Attention, then the default method (a context the default
        reads whole is Full Attention over the same prompt: its answer is Full's, not decoded twice)."""
        for name, rag in self.engines.items():
            if not self._todo(set_name, ex.id, name, 0):
                continue
            full = rag.prefill(ex.question, chunks=ex.chunks, method="full", prefix_cache=False)
            full_text = rag.decode(full, max_new_tokens=self.max_new_tokens).answer().text
            pre = rag.prefill(ex.question, chunks=ex.chunks, prefix_cache=False)
            whole = bool(pre.stats.full_reason)
            text = full_text if whole else rag.decode(pre, max_new_tokens=self.max_new_tokens).answer().text
            base = {"set": set_name, "row": ex.id, "half": half, "layout": name, "turn": 0}
            self._write({**base, "method": "full", "answer": full_text, "contains": contains(full_text, ex.answers), "agree": 1.0})
            self._write({**base, "method": "default", "answer": text, "contains": contains(text, ex.answers),
                         "agree": agreement(text, full_text), "read_whole": whole, "method_name": pre.stats.method})

    def _turns(self, rag: Any, case: ConversationCase, method: str | None, whole_as: tuple[str, str] | None = None) -> tuple[str, str]:
        """Turn one, then turn two after it (`method` None: the engine's default; a conversation it reads whole is
        Full Attention over the same prompts, so `whole_as`, Full's answers, are its answers)."""
        (q1, _), (q2, _) = case.turns
        opts = {"prefix_cache": False, **({"method": method} if method else {})}
        first = Conversation.ask(q1)
        pre = rag.prefill(messages=first, chunks=case.chunks_for(1), **opts)
        if whole_as is not None and pre.stats.full_reason:
            return whole_as
        one = rag.decode(pre, max_new_tokens=self.max_new_tokens).answer().text
        pre = rag.prefill(messages=first.with_answer(one, q2), chunks=case.chunks_for(2), **opts)
        if whole_as is not None and pre.stats.full_reason and one == whole_as[0]:
            return whole_as  # turn two read whole after the same turn one: Full's answer
        return one, rag.decode(pre, max_new_tokens=self.max_new_tokens).answer().text

    def answer_conversation(self, case: ConversationCase, half: str, set_name: str = CONVERSATIONS) -> None:
        """Both turns under every layout (turn two after that layout's own turn one), and the model's own template."""
        (q1, gold1), (q2, gold2) = case.turns
        for name, rag in self.engines.items():
            if not self._todo(set_name, case.id, name, 2):
                continue
            texts = {"full": self._turns(rag, case, "full")}
            texts["default"] = self._turns(rag, case, None, whole_as=texts["full"])
            for method, (t1, t2) in texts.items():
                for turn, text, gold in ((1, t1, gold1), (2, t2, gold2)):
                    self._write({"set": set_name, "row": case.id, "half": half, "layout": name, "method": method, "turn": turn,
                                 "answer": text, "contains": contains(text, gold), "agree": agreement(text, texts["full"][turn - 1])})
        if (set_name, case.id, REFERENCE, "full", 2) not in self.done:
            rag = next(iter(self.engines.values()))
            system = [("system", "\n\n".join(c.text for c in case.chunks_for(turn))) for turn in (1, 2)]
            opts = {"max_new_tokens": self.max_new_tokens, "prefix_cache": False}
            one = rag.chat([system[0], ("user", q1)], **opts)  # no chunks: plain chat, the messages through the chat template
            two = rag.chat([system[1], ("user", q1), ("assistant", one.text), ("user", q2)], **opts)
            for turn, text, gold in ((1, one.text, gold1), (2, two.text, gold2)):
                self._write({"set": set_name, "row": case.id, "half": half, "layout": REFERENCE, "method": "full", "turn": turn,
                             "answer": text, "contains": contains(text, gold), "agree": 1.0})


def set_rows(sets: Sequence[str], data: Path, n: int | None) -> Iterator[tuple[str, list[Example]]]:
    from kvrag.eval.suite import SETS

    for name in sets:
        if name in CONVERSATION_SETS:
            continue
        spec = SETS[name]
        yield name, spec.build(data, n or min(spec.n, DEFAULT_N))


def run_layout(lm: Any, out: Path, data: Path, sets: Sequence[str], n: int | None = None, layouts: Sequence[str] | None = None,
               max_new_tokens: int = DEFAULT_NEW_TOKENS, conversations: int | None = None, progress: bool = True) -> Path:
    """Answer everything (conversations first: the question the layout was chosen for), resumable; returns the records."""
    from tqdm.auto import tqdm

    chosen = {k: CANDIDATES[k] for k in (layouts or CANDIDATES)}
    out.mkdir(parents=True, exist_ok=True)
    runner = LayoutRun(lm, chosen, out, max_new_tokens)
    loaders = {CONVERSATIONS: load_conversations, CONVERSATIONS_INDEX: load_index_conversations}
    for set_name in [s for s in CONVERSATION_SETS if s in sets]:
        cases = loaders[set_name]()[:conversations]
        ids = [c.id for c in cases]
        for case in tqdm(cases, desc=set_name, disable=not progress):
            runner.answer_conversation(case, half_of(set_name, case.id, ids), set_name)
    for name, examples in set_rows(sets, data, n):
        ids = [e.id for e in examples]
        for ex in tqdm(examples, desc=name, disable=not progress):
            runner.answer_row(name, ex, half_of(name, ex.id, ids))
    return runner.records
