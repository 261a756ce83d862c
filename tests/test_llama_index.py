"""LlamaIndex integration with the real LlamaIndex classes (and a real chroma store end to end)."""

import asyncio

import pytest
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from kvrag import KVRag, from_model
from kvrag.integrations.llama_index import KVCacheNodePostprocessor, KVRagIngestion, KVRagLLM, MiniLMEmbedding
from tiny import tiny_model, tiny_tokenizer

NODES = [
    TextNode(id_="n1", text="The Eiffel Tower is a wrought-iron tower in Paris, completed in 1889.", metadata={"title": "Eiffel Tower"}),
    TextNode(id_="n2", text="Honeybees make honey from flower nectar inside the hive."),
    TextNode(id_="n3", text="The Brannoch Line is a mountain railway that opened in 1893."),
]


@pytest.fixture(scope="module")
def tiny_llm():
    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://")
    return KVRagLLM(rag=rag, max_new_tokens=4)


def test_llm_interface(tiny_llm):
    assert tiny_llm.metadata.context_window == 4096
    out = tiny_llm.complete("Say something.")
    assert isinstance(out.text, str) and tiny_llm.last_stats.path == "plain"
    pieces = list(tiny_llm.stream_complete("Say something."))
    assert pieces[-1].text == "".join(p.delta or "" for p in pieces)
    assert pieces[-1].text == out.text
    chat = tiny_llm.chat([ChatMessage(role="user", content="Hi")])
    assert chat.message.role == "assistant"
    assert asyncio.run(tiny_llm.acomplete("Say something.")).text == out.text


def test_ingestion_then_postprocessor_path(tiny_llm):
    pipeline = IngestionPipeline(transformations=[KVRagIngestion(tiny_llm, progress=False)])
    assert len(pipeline.run(nodes=NODES)) == 3
    assert tiny_llm.rag.precompute([], progress=False).chunks == 0
    post = KVCacheNodePostprocessor(tiny_llm)
    kept = post.postprocess_nodes([NodeWithScore(node=n, score=1.0) for n in NODES[:2]], QueryBundle("Where is it?"))
    assert [n.node.node_id for n in kept] == ["n1", "n2"]
    tiny_llm.complete("Translate 'good morning' into French.")  # an unrelated call does not take the hand-over (#18)
    assert tiny_llm.last_stats.path == "plain"
    tiny_llm.complete("Context: whatever the synthesizer built\nQuery: Where is it?\nAnswer: ")  # the call made for the query
    stats = tiny_llm.last_stats
    assert stats.path == "postprocessor" and stats.cache_hits == 2 and stats.chunk_prefill_tokens == 0
    tiny_llm.complete("Say something.")  # the hand-over served one call only
    assert tiny_llm.last_stats.path == "plain"


def test_prompt_match_path_without_postprocessor(tiny_llm):
    KVRagIngestion(tiny_llm, progress=False)(NODES)
    prompt = f"Context information is below.\n---\n{NODES[2].text}\n\n{NODES[0].text}\n---\nQuery: When?\nAnswer: "
    tiny_llm.complete(prompt)
    stats = tiny_llm.last_stats
    assert stats.path == "prompt-match" and stats.cache_hits == 2 and stats.chunk_prefill_tokens == 0


@pytest.mark.smollm
def test_query_engine_over_chroma_end_to_end(smollm, tmp_path):
    import chromadb
    from llama_index.vector_stores.chroma import ChromaVectorStore

    llm = KVRagLLM(rag=KVRag(smollm, store=f"disk://{tmp_path}/kv"), method="a3", max_new_tokens=24)
    client = chromadb.PersistentClient(path=str(tmp_path / "chroma"), settings=chromadb.Settings(anonymized_telemetry=False))
    store = ChromaVectorStore(chroma_collection=client.get_or_create_collection("li_test"))
    docs = [Document(text=n.text, id_=n.node_id, metadata=dict(n.metadata)) for n in NODES]
    embed = MiniLMEmbedding()
    index = VectorStoreIndex.from_documents(
        docs,
        storage_context=StorageContext.from_defaults(vector_store=store),
        embed_model=embed,
        transformations=[KVRagIngestion(llm, progress=False)],
    )
    engine = index.as_query_engine(llm=llm, similarity_top_k=2, node_postprocessors=[KVCacheNodePostprocessor(llm)])
    first = engine.query("In which city is the Eiffel Tower?")
    assert "Paris" in str(first)
    second = engine.query("In which city is the Eiffel Tower?")
    stats = llm.last_stats
    assert "Paris" in str(second)
    assert stats.path == "postprocessor" and stats.cache_hits == 2 and stats.chunk_prefill_tokens == 0
    plain = index.as_query_engine(llm=llm, similarity_top_k=2)  # no postprocessor: the prompt-match path
    third = plain.query("In which city is the Eiffel Tower?")
    assert "Paris" in str(third)
    assert llm.last_stats.path == "prompt-match" and llm.last_stats.cache_hits == 2
