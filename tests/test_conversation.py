"""Conversations: the chat template over the whole conversation, and the exact prefix cache that lets a
turn read only its new tokens (kvrag.chat, kvrag.kv.layout, kvrag.kv.prefix_cache, the pipeline)."""

import pytest
import torch

from kvrag import Chunk, KVRag
from kvrag.chat import Conversation
from kvrag.kv.prefix_cache import PrefixCache
from kvrag.model.cache import cache_arg
from kvrag.model.loading import from_model
from tiny import ARCHS, tiny_model, tiny_tokenizer

CHUNKS = [
    Chunk("a", "The cat sat on the mat and purred all afternoon."),
    Chunk("b", "Volcanoes erupt lava, ash and gas from deep below.", title="Geology"),
    Chunk("c", "Paris is the capital of France; the Seine runs through it."),
]
IDS = [c.id for c in CHUNKS]
TURN1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What did the cat do?"}]


def turn2(answer: str, question: str = "And where was it?") -> list[dict]:
    return TURN1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]


def make_rag(arch: str = "llama", layout=None) -> KVRag:
    rag = KVRag(from_model(tiny_model(arch), tiny_tokenizer()), store="memory://", layout=layout)
    rag.precompute(CHUNKS, progress=False)
    return rag


def reference_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def model_logits(lm, ids) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(input_ids=torch.tensor([ids])).logits[0, -1].float()


# -- the layout ---------------------------------------------------------------------------------
def test_one_question_is_the_one_message_case():
    rag = make_rag()
    layout, ids = rag.layout, [rag.layout.chunk_ids(c) for c in CHUNKS]
    assert layout.conversation_segments(ids, Conversation.ask("What did the cat do?")) == layout.segments(ids, "What did the cat do?")


def test_the_callers_system_text_follows_the_documents():
    rag = make_rag()  # the default layout: the documents in the system message, no instruction, the questions as written
    messages = rag.layout.conversation_messages(CHUNKS, Conversation.of(turn2("It purred.")))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert rag.layout.system_prompt == "" and system.startswith(CHUNKS[0].text[:20]) and system.endswith("\nBe brief.")
    with_instruction = make_rag(layout="instruction").layout.conversation_messages(CHUNKS, Conversation.of(turn2("It purred.")))
    assert with_instruction[0]["content"].startswith("You are a helpful assistant.")
    assert all(c.text in system for c in CHUNKS) and "Document:" not in system
    assert messages[1]["content"] == "What did the cat do?" and messages[3]["content"] == "And where was it?"


def test_under_the_v1_layout_the_documents_open_the_first_user_turn():
    rag = make_rag(layout="v1")
    messages = rag.layout.conversation_messages(CHUNKS, Conversation.of(turn2("It purred.")))
    assert messages[0] == {"role": "system", "content": rag.layout.system_prompt + "\n\nBe brief."}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[1]["content"].startswith("Document: The cat sat") and messages[1]["content"].endswith("Question: What did the cat do?")
    assert messages[3]["content"] == "Question: And where was it?"


def test_messages_in_every_shape_make_the_same_conversation():
    from types import SimpleNamespace

    as_dicts = Conversation.of(turn2("It purred."))
    as_pairs = Conversation.of([(m["role"], m["content"]) for m in turn2("It purred.")])
    as_objects = Conversation.of([SimpleNamespace(type={"user": "human", "assistant": "ai"}.get(m["role"], m["role"]), content=m["content"])
                                  for m in turn2("It purred.")])
    assert as_dicts == as_pairs == as_objects
    assert as_dicts.system == "Be brief." and as_dicts.question == "And where was it?"
    assert as_dicts.retrieval_query() == "What did the cat do?\nAnd where was it?"
    with pytest.raises(ValueError, match="end with a user message"):
        Conversation.of(turn2("It purred.")[:-1])
    with pytest.raises(ValueError, match="unsupported message role"):
        Conversation.of([{"role": "tool", "content": "{}"}, {"role": "user", "content": "q"}])


@pytest.mark.parametrize("arch", ARCHS)
def test_full_over_a_conversation_is_the_chat_template_token_for_token(arch):
    rag = make_rag(arch)
    messages = turn2("It purred all afternoon.")
    pre = rag.prefill(messages=messages, chunk_ids=IDS, method="full", prefix_cache=False)
    ref = reference_ids(rag.lm.tokenizer, rag.layout.conversation_messages(CHUNKS, Conversation.of(messages)))
    assert pre.segments.all_ids() == ref
    assert (pre.logits - model_logits(rag.lm, ref)).abs().max().item() <= 1e-4


def test_plain_chat_is_the_models_own_chat_template():
    rag = make_rag()
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "How are you?"}]
    answer = rag.chat(messages, max_new_tokens=4)
    pre = rag.pipeline.prefill(Conversation.of(messages), rag.repo.lookup(None, None, allow_empty=True),
                               rag._options(None, {"method": "full", "prefix_cache": False}), documents=False)
    assert pre.segments.all_ids() == reference_ids(rag.lm.tokenizer, messages)
    assert answer.stats.path == "plain" and answer.stats.turns == 3


# -- the exact prefix cache -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_a_prefix_hit_answers_as_a_miss_under_full_attention(arch):
    rag = make_rag(arch)
    first = rag.chat(TURN1, IDS, method="full", max_new_tokens=6)
    messages = turn2(first.text or "It purred.")
    hit = rag.prefill(messages=messages, chunk_ids=IDS, method="full")
    miss = rag.prefill(messages=messages, chunk_ids=IDS, method="full", prefix_cache=False)
    assert hit.stats.prefix_hit_tokens > len(hit.segments.prefix) + hit.segments.chunk_tokens
    assert miss.stats.prefix_hit_tokens == 0
    assert (hit.logits - miss.logits).abs().max().item() <= 1e-4
    a = rag.chat(messages, IDS, method="full", max_new_tokens=8)
    b = rag.chat(messages, IDS, method="full", max_new_tokens=8, prefix_cache=False)
    assert a.stats.prefix_hit_tokens > 0 and a.text == b.text


@pytest.mark.parametrize("arch", ARCHS)
def test_an_approximate_hit_continues_turn_one_as_it_was_computed(arch):
    """Turn two over cacheblend's turn one: identical to recomputing turn one the way it was, then the rest."""
    rag = make_rag(arch)
    rag.chat(TURN1, IDS, method="cacheblend", max_new_tokens=4)
    messages = turn2("It purred on the mat.")
    hit = rag.prefill(messages=messages, chunk_ids=IDS, method="cacheblend")
    first = rag.prefill(messages=TURN1, chunk_ids=IDS, method="cacheblend", prefix_cache=False)
    n = first.segments.total_len
    assert hit.stats.prefix_hit_tokens >= n and hit.stats.recomputed_tokens == 0
    rest = hit.segments.all_ids()[n:]
    with torch.no_grad():
        out = rag.lm.model(input_ids=torch.tensor([rest]), position_ids=torch.arange(n, n + len(rest))[None],
                           **cache_arg(rag.lm.model, first.output.cache), use_cache=True)
    assert (hit.logits - out.logits[0, -1].float()).abs().max().item() <= 1e-4


def test_approximate_entries_serve_only_their_method_and_never_a_cut():
    rag = make_rag()
    rag.chat(TURN1, IDS, method="cacheblend", max_new_tokens=4)
    messages = turn2("It purred.")
    assert rag.prefill(messages=messages, chunk_ids=IDS, method="full").stats.prefix_hit_tokens == 0  # another method
    assert rag.prefill(messages=messages, chunk_ids=IDS, method="cacheblend", recompute_ratio=0.5).stats.prefix_hit_tokens == 0
    other = [TURN1[0], {"role": "user", "content": "Which city is the capital of France?"}]  # the same chunks, another question
    assert rag.prefill(messages=other, chunk_ids=IDS, method="cacheblend").stats.prefix_hit_tokens == 0


def test_repeated_whole_reads_pay_once(shipped_defaults):
    """Short contexts are read whole (Full Attention): a second question over the same chunks reads only its own tokens."""
    rag = make_rag()
    one = rag.answer("What did the cat do?", IDS, max_new_tokens=4)
    assert one.stats.full_reason
    two = rag.answer("Where is the Seine?", IDS, max_new_tokens=6)
    again = rag.answer("Where is the Seine?", IDS, max_new_tokens=6, prefix_cache=False)
    assert two.stats.prefix_hit_tokens >= two.stats.prompt_tokens - two.stats.question_tokens
    assert two.stats.recomputed_tokens == 0 and two.text == again.text


def test_the_prefix_cache_can_be_turned_off():
    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://", prefix_cache=PrefixCache(0))
    rag.precompute(CHUNKS, progress=False)
    first = rag.chat(TURN1, IDS, method="full", max_new_tokens=4)
    assert rag.chat(turn2(first.text), IDS, method="full", max_new_tokens=4).stats.prefix_hit_tokens == 0
    on = make_rag()
    on.chat(TURN1, IDS, method="full", max_new_tokens=4, prefix_cache=False)  # neither read nor kept
    assert on.prefix_cache.snapshot().entries == 0


def _kv(n: int, fill: float = 1.0):
    return [(torch.full((1, 2, n + 3, 4), fill), torch.full((1, 2, n + 3, 4), fill)) for _ in range(3)]


def test_the_prefix_cache_is_bounded_least_recently_used_first():
    one_entry = 2 * 3 * 2 * 10 * 4 * 4  # keys + values, 3 layers, 2 heads, 10 tokens, 4 dims, float32
    cache = PrefixCache(max_bytes=2 * one_entry)
    a, b, c = list(range(10)), list(range(100, 110)), list(range(200, 210))
    assert cache.store("exact", a, _kv(10))
    assert cache.store("exact", b, _kv(10))
    assert cache.lookup("exact", a + [7], floor=0).tokens == 10  # a is now the most recent
    assert cache.store("exact", c, _kv(10))
    snap = cache.snapshot()
    assert snap.entries == 2 and snap.bytes <= 2 * one_entry and snap.evicted == 1
    assert cache.lookup("exact", b + [1]) is None and cache.lookup("exact", a + [1]) is not None
    assert cache.lookup("other", a + [1]) is None  # another signature
    assert cache.lookup("exact", a[:5] + [99], floor=5) is None  # no longer than the floor
    hit = cache.lookup("exact", a[:6] + [99])
    assert hit.tokens == 6 and hit.stack[0].shape[2] == 6  # an exact entry serves any prefix of itself
    assert cache.lookup("exact", a).tokens == 9  # one token always left to read
    cache.store("approx", c, _kv(10), min_hit=10)
    assert cache.lookup("approx", c[:8] + [5]) is None and cache.lookup("approx", c + [5]).tokens == 10
    cache.store("exact", a + [1, 2], _kv(12))  # extends a: replaces it
    assert cache.snapshot().by_signature.get("exact") == 1


def test_an_answer_says_how_it_read_its_context():
    from kvrag.types import AnswerStats

    reused = AnswerStats(method="fusionrag", recomputed_tokens=84, context_tokens=560, ttft_s=0.2, cache_hits=5)
    assert reused.reading().startswith("fusionrag recomputed 15% (84 of 560 chunk tokens) | chunk KV hits 5, misses 0")
    whole = AnswerStats(method="fusionrag", full_reason="560 chunk tokens <= short_context=768: answered with Full Attention",
                        context_tokens=560, prefix_hit_tokens=600, prompt_tokens=640)
    assert whole.reading().startswith("read whole: 560 chunk tokens <= short_context=768; 600 of 640 prompt tokens from the previous turn")


@pytest.mark.smollm
def test_precomputed_chunks_are_found_when_answered(smollm):
    """precompute and answer tokenise a chunk the same way (the chat template's boundary, where byte-level BPE
    splits "\n\n" before a word): every precomputed chunk is a hit, in a fresh process too."""
    rag = KVRag(smollm, store="memory://", check=False)
    rag.precompute(CHUNKS, progress=False)
    rag.layout._chunk_ids_memo.clear()  # as in a fresh process: nothing memoised by the precompute
    stats = rag.prefill("What did the cat do?", IDS, method="reuse").stats
    assert stats.cache_hits == len(CHUNKS) and stats.cache_misses == 0


@pytest.mark.smollm
def test_full_over_a_conversation_is_the_bundled_models_chat_template(smollm):
    rag = KVRag(smollm, store="memory://", check=False)
    conv = Conversation.of(turn2("It purred all afternoon."))
    segments = rag.layout.conversation_segments([rag.layout.chunk_ids(c) for c in CHUNKS], conv)
    assert segments.all_ids() == reference_ids(rag.lm.tokenizer, rag.layout.conversation_messages(CHUNKS, conv))
    one = Conversation.ask("What did the cat do?")
    segments = rag.layout.conversation_segments([rag.layout.chunk_ids(c) for c in CHUNKS], one)
    assert segments.all_ids() == reference_ids(rag.lm.tokenizer, rag.layout.conversation_messages(CHUNKS, one))


@pytest.mark.smollm
@pytest.mark.parametrize("method", ["full", "fusionrag"])
def test_turn_two_on_the_bundled_model_reads_only_its_new_tokens(smollm, method):
    """Full Attention: with the prefix cache turn two answers token for token as without it. fusionrag (policies
    off here): turn two continues turn one's state, and reads only the tokens after it either way."""
    rag = KVRag(smollm, store="memory://", check=False)
    chunks = [Chunk("brannoch", "The Brannoch Line opened in 1893. Its chief engineer was Isobel Carrick."),
              Chunk("averly", "The Averly Light was first lit in 1839 and is 38 metres tall."),
              Chunk("marrow", "The capital of Isle Marrow is Saltmere.")]
    first = rag.chat([("user", "Who was the chief engineer of the Brannoch Line?")], chunks=chunks, method=method)
    messages = [("user", "Who was the chief engineer of the Brannoch Line?"), ("assistant", first.text), ("user", "When did it open?")]
    hit = rag.chat(messages, chunks=chunks, method=method)
    assert hit.stats.prefix_hit_tokens >= hit.stats.prompt_tokens - 20 and hit.stats.recomputed_tokens == 0
    if method == "full":  # (fusionrag over one-sentence chunks, policies off, is often wrong: README Results)
        assert "1893" in hit.text, hit.text
        assert hit.text == rag.chat(messages, chunks=chunks, method=method, prefix_cache=False).text
