"""Chunks a framework pasted into its messages are read from their cached KV, and the caller's own
system text still reaches the model (kvrag.ingest.prompt_match.match_conversation)."""

from __future__ import annotations

import pytest

from kvrag.chat import Conversation
from kvrag.ingest.prompt_match import after_context, match_conversation
from kvrag.types import Chunk

A = Chunk(id="a", text="The Brannoch Line is a mountain railway that opened in 1893.")
B = Chunk(id="b", text="Honeybees make honey from flower nectar inside the hive.")


def test_a_context_message_keeps_what_follows_its_last_chunk_and_other_system_messages_whole():
    context = f"Use the context information below.\n--------------------\n{A.text}\n\n{B.text}\n--------------------\nAnswer like a pirate."
    conv = Conversation.of([("system", "Be brief."), ("system", context), ("user", "When did it open?")])
    found, rest = match_conversation(conv, [A, B])
    assert [c.id for c in found] == ["a", "b"]
    assert rest.system_parts == ("Be brief.", "Answer like a pirate.") and rest.system == "Be brief.\n\nAnswer like a pirate."
    assert rest.turns == (("user", "When did it open?"),)


def test_a_context_message_with_nothing_after_its_chunks_leaves_no_system_text():
    conv = Conversation.of([("system", f"Context:\n{A.text}\n-----"), ("user", "When?")])
    found, rest = match_conversation(conv, [A])
    assert [c.id for c in found] == ["a"] and rest.system == "" and rest.system_parts == ()


def test_without_known_chunks_the_conversation_is_untouched():
    conv = Conversation.of([("system", "Be brief."), ("user", "Hi")])
    assert match_conversation(conv, [A]) == ([], conv)


def test_separator_lines_are_dropped_and_words_kept():
    assert after_context("\n---\n====\n\nInstruction: answer briefly.\n- keep this\n") == "Instruction: answer briefly.\n- keep this"


def test_the_system_text_joined_elsewhere_is_one_part():
    conv = Conversation(turns=(("user", "Q?"),), system=f"{A.text}\nBe brief.")
    found, rest = match_conversation(conv, [A])
    assert [c.id for c in found] == ["a"] and rest.system == "Be brief."


def test_a_llama_index_context_chat_engine_passes_its_system_prompt_through():
    """The real ContextChatEngine puts its system_prompt after the context block in one system message:
    the prompt the model reads grows by it (it was dropped with the context's wrapper)."""
    pytest.importorskip("llama_index.core")
    from llama_index.core import VectorStoreIndex
    from llama_index.core.chat_engine import ContextChatEngine
    from llama_index.core.schema import TextNode

    from kvrag import KVRag, from_model
    from kvrag.integrations.llama_index import KVRagIngestion, KVRagLLM, MiniLMEmbedding
    from tiny import tiny_model, tiny_tokenizer

    nodes = [TextNode(id_=c.id, text=c.text) for c in (A, B)]
    llm = KVRagLLM(rag=KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://"), max_new_tokens=2)
    KVRagIngestion(llm, progress=False)(nodes)
    retriever = VectorStoreIndex(nodes, embed_model=MiniLMEmbedding()).as_retriever(similarity_top_k=2)
    counts = {}
    for prompt in ("", "Answer like a pirate, in one short sentence."):
        engine = ContextChatEngine.from_defaults(retriever=retriever, llm=llm, system_prompt=prompt or None)
        engine.chat("When did the Brannoch Line open?")
        stats = llm.last_stats
        assert stats.path == "prompt-match" and stats.cache_hits == 2
        counts[prompt] = stats.prompt_tokens
    assert counts["Answer like a pirate, in one short sentence."] >= counts[""] + len("Answer like a pirate")
