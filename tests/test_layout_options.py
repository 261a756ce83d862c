"""The prompt layout as one options object (kvrag.kv.layout_options): validated when made, every place and template
read by Full Attention as the chat template renders it, each chunk's KV depending on nothing but the layout's
prefix, and the layout in the cache key. Tiny random models; the bundled tokenizer where its merges matter."""

import json

import pytest
import torch

from kvrag import Chunk, KVRag, LayoutOptions, from_model
from kvrag.chat import Conversation
from kvrag.eval.layout_eval import CANDIDATES
from kvrag.kv.layout import PromptLayout
from kvrag.kv.layout_options import DEFAULT_LAYOUT, V1_LAYOUT
from tiny import ARCHS, tiny_model, tiny_tokenizer

CHUNKS = [
    Chunk("a", "The cat sat on the mat and purred all afternoon."),
    Chunk("b", "Volcanoes erupt lava, ash and gas from deep below.", title="Geology"),
    Chunk("c", "Paris is the capital of France; the Seine runs through it."),
]
IDS = [c.id for c in CHUNKS]
TURNS = [("system", "Be brief."), ("user", "What did the cat do?"), ("assistant", "It purred."), ("user", "And where was it?")]


def reference_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def make_rag(layout, arch="llama") -> KVRag:
    rag = KVRag(from_model(tiny_model(arch), tiny_tokenizer()), store="memory://", layout=layout)
    rag.precompute(CHUNKS, progress=False)
    return rag


# -- validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, field", [
    ({"chunk_template": "Document: {title}\n"}, "chunk_template"),
    ({"untitled_chunk_template": "Document:\n"}, "untitled_chunk_template"),
    ({"question_template": "Question:"}, "question_template"),
    ({"chunk_template": "{text} {source}"}, "chunk_template"),
    ({"chunk_template": "{text"}, "chunk_template"),
    ({"place": "footer"}, "place"),
    ({"history": "before"}, "history"),  # the documents come before the conversation unless they are a turn of their own
    ({"colour": "blue"}, "colour"),
])
def test_a_bad_layout_is_refused_naming_its_field(bad, field):
    with pytest.raises(ValueError, match=field):
        LayoutOptions.of(bad)
    with pytest.raises(ValueError, match=field):
        KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://", check=False, layout=bad)


def test_a_layout_comes_as_options_a_dict_a_preset_json_or_a_file(tmp_path):
    opts = LayoutOptions(place="user", instruction="Be brief.", question_template="Q: {question}")
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(opts.to_dict()))
    assert LayoutOptions.of(opts) == LayoutOptions.of(opts.to_dict()) == LayoutOptions.of(json.dumps(opts.to_dict())) == opts
    assert LayoutOptions.of(str(path)) == LayoutOptions.of(path) == opts
    assert LayoutOptions.of("v1") == V1_LAYOUT and LayoutOptions.of(None) == DEFAULT_LAYOUT
    assert LayoutOptions.of({"preset": "v1", "question_template": "{question}"}) == V1_LAYOUT.replace(question_template="{question}")
    assert LayoutOptions(chunk_template="[{title}] {text}\n").untitled == "{text}\n"
    assert LayoutOptions(chunk_template="{title}\n{text}\n").untitled == "{text}\n"


def test_the_engines_keywords_change_one_field_of_the_layout():
    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://", check=False, layout="v1", system_prompt="Be terse.")
    assert rag.layout.options == V1_LAYOUT.replace(instruction="Be terse.")


# -- Full Attention reads the chat template's rendering, whatever the layout ------------------------------
@pytest.mark.parametrize("name", list(CANDIDATES))
@pytest.mark.parametrize("arch", ARCHS)
def test_full_over_every_layout_is_the_chat_template_token_for_token(name, arch):
    rag = make_rag(CANDIDATES[name], arch)
    tok = rag.lm.tokenizer
    for conv in (Conversation.ask("What did the cat do?"), Conversation.of(TURNS)):
        pre = rag.prefill(messages=conv, chunk_ids=IDS, method="full", prefix_cache=False)
        ref = reference_ids(tok, rag.layout.conversation_messages(CHUNKS, conv))
        assert pre.segments.all_ids() == ref
        with torch.no_grad():
            logits = rag.lm.model(input_ids=torch.tensor([ref])).logits[0, -1].float()
        assert (pre.logits - logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_one_chunk_after_every_layouts_prefix_reuses_exactly(name):
    """A chunk's KV depends on nothing but the layout's prefix: one chunk reused right after it is Full Attention."""
    rag = make_rag(CANDIDATES[name])
    full = rag.prefill("What did the cat do?", ["b"], method="full")
    reuse = rag.prefill("What did the cat do?", ["b"], method="reuse")
    assert reuse.stats.cache_hits == 1 and reuse.stats.recomputed_tokens == 0
    assert (full.logits - reuse.logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_a_chunks_ids_never_depend_on_its_neighbours_or_rank(name):
    layout = PromptLayout(tiny_tokenizer(), CANDIDATES[name])
    ids = {c.id: layout.chunk_ids(c) for c in CHUNKS}
    for order in (CHUNKS, CHUNKS[::-1]):
        seg = layout.conversation_segments([layout.chunk_ids(c) for c in order], Conversation.of(TURNS))
        assert seg.chunks == [ids[c.id] for c in order]


def test_where_the_documents_go():
    tok = tiny_tokenizer()
    conv = Conversation.of(TURNS)
    system = PromptLayout(tok, CANDIDATES["chat"]).conversation_messages(CHUNKS, conv)
    assert system[0]["role"] == "system" and system[0]["content"].startswith("The cat sat") and system[0]["content"].endswith("Be brief.")
    assert [m["content"] for m in system[1:]] == ["What did the cat do?", "It purred.", "And where was it?"]
    turn = PromptLayout(tok, CANDIDATES["chat@turn"]).conversation_messages(CHUNKS, conv)
    assert [m["role"] for m in turn] == ["system", "user", "user", "assistant", "user"] and turn[1]["content"].startswith("The cat sat")
    late = PromptLayout(tok, CANDIDATES["chat@turn-late"]).conversation_messages(CHUNKS, conv)
    assert [m["role"] for m in late] == ["system", "user", "assistant", "user", "user"] and late[3]["content"].startswith("The cat sat")
    v1 = PromptLayout(tok, V1_LAYOUT).conversation_messages(CHUNKS, conv)
    assert v1[1]["content"].startswith("Document: The cat sat") and v1[1]["content"].endswith("Question: What did the cat do?")


@pytest.mark.smollm
def test_a_chunk_template_the_bundled_tokenizer_splits_differently_at_the_end_is_refused(smollm):
    """byte-level BPE merges "\\n\\n" at the end of the system message but not before the next document: the
    segments would not be the chat template's rendering, so the layout says so when made."""
    with pytest.raises(ValueError, match="documents_end"):
        PromptLayout(smollm.tokenizer, LayoutOptions(place="system", chunk_template="{text}\n\n"))
    PromptLayout(smollm.tokenizer, LayoutOptions(place="system", chunk_template="{text}\n\n", documents_end="End of the documents."))
    for opts in CANDIDATES.values():
        PromptLayout(smollm.tokenizer, opts)


# -- the layout in the cache key ---------------------------------------------------------------------
def test_two_layouts_never_share_chunk_kv_that_differs():
    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    from kvrag.cache_backends import open_store

    store = open_store("memory://")
    KVRag(lm, store=store, layout="v1").precompute(CHUNKS, progress=False)
    other = KVRag(lm, store=store, layout=CANDIDATES["chat"])
    stats = other.prefill("What did the cat do?", chunks=CHUNKS, method="reuse").stats
    assert stats.cache_hits == 0 and stats.cache_misses == len(CHUNKS)
    again = KVRag(lm, store=store, layout="v1").prefill("What did the cat do?", chunks=CHUNKS, method="reuse").stats
    assert again.cache_hits == len(CHUNKS)


def test_a_new_layout_version_makes_old_entries_misses(monkeypatch):
    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    from kvrag.cache_backends import open_store
    import kvrag.kv.layout as layout_module

    store = open_store("memory://")
    KVRag(lm, store=store).precompute(CHUNKS, progress=False)
    monkeypatch.setattr(layout_module, "LAYOUT_VERSION", layout_module.LAYOUT_VERSION + ".next")
    rag = KVRag(lm, store=store, link_adapter=None)
    stats = rag.prefill("What did the cat do?", chunks=CHUNKS, method="reuse").stats
    assert stats.cache_hits == 0 and stats.cache_misses == len(CHUNKS)


# -- the faces: one layout object on `kvrag serve` and the integrations, checked at start ------------------
def test_kvrag_serve_takes_the_layout_as_one_json_option_and_refuses_a_bad_one(tmp_path, monkeypatch):
    import argparse

    from kvrag.cli.serve import add_serve_parser, settings_from_args
    from kvrag.server import ServerSettings

    monkeypatch.delenv("KVRAG_LAYOUT", raising=False)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    given = '{"place": "user", "question_template": "Q: {question}"}'
    settings = settings_from_args(parser.parse_args(["serve", "--layout", given]))
    assert settings.layout_options == LayoutOptions.of(given)
    path = tmp_path / "layout.json"
    path.write_text(json.dumps({"preset": "v1"}))
    assert settings_from_args(parser.parse_args(["serve", "--layout", str(path)])).layout_options == V1_LAYOUT
    assert settings_from_args(parser.parse_args(["serve"])).layout_options == DEFAULT_LAYOUT
    with pytest.raises(ValueError, match="chunk_template"):
        settings_from_args(parser.parse_args(["serve", "--layout", '{"chunk_template": "Document:"}']))
    with pytest.raises(ValueError, match="chunk_template"):
        ServerSettings(layout={"chunk_template": "no text here"})


def test_the_integrations_take_the_layout_and_check_it_when_made():
    pytest.importorskip("llama_index.core")
    from kvrag.integrations.langchain import ChatKVRag
    from kvrag.integrations.llama_index import KVRagLLM

    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://", check=False, layout=CANDIDATES["chat"])
    for make in (lambda **kw: KVRagLLM(**kw), lambda **kw: ChatKVRag(**kw)):
        with pytest.raises(ValueError, match="chunk_template"):
            make(layout={"chunk_template": "Document:"}, rag=rag)
        with pytest.raises(ValueError, match="another layout"):
            make(layout="v1", rag=rag)  # the engine given has its own
        with pytest.raises(ValueError, match="kvrag serve --layout"):
            make(layout="v1", server="http://127.0.0.1:1")
        assert make(layout=CANDIDATES["chat"], rag=rag).layout == CANDIDATES["chat"].to_dict()
    lazy = ChatKVRag(layout={"preset": "v1", "instruction": "Be terse."})  # no model loaded yet: checked all the same
    assert LayoutOptions.of(lazy.layout) == V1_LAYOUT.replace(instruction="Be terse.")
