"""Issue #39: prompt-lookup drafts (kvrag.decode.draft) make decoding take fewer forwards, never other tokens.

A step feeds the token chosen plus tokens drafted from the prompt and the answer so far; the rows of
the drafts are the logits the following steps would compute, served when the token chosen is the one
drafted. Checked on a tiny random model of every supported architecture: the same tokens with drafts
as without (greedy and sampled with a seed), drafts that are right served without forwards, drafts
that are wrong costing nothing but their rows, and each row of a multi-row step the logits of that
token stepped alone. On the bundled model: the sample's questions answer the same with and without.
"""

import threading

import pytest
import torch

from kvrag import KVRag, from_model
from kvrag.decode.batch import batcher_for
from kvrag.decode.draft import PromptLookup
from kvrag.decode.lean import lean_step
from kvrag.decode.stream import DecodeConfig, DecodeState, stream_tokens
from tiny import ARCHS, THREE_CHUNKS, THREE_IDS, THREE_Q, tiny_model, tiny_tokenizer


def test_lookup_proposes_what_followed_the_latest_longest_match():
    look = PromptLookup([1, 2, 3, 4, 9, 2, 3, 5, 6])
    look.append(2)
    look.append(3)  # tail [.., 2, 3]: latest earlier "2 3" is followed by 5 6; "6 2 3" never occurred
    assert look.propose(2) == [5, 6]
    assert look.propose(5) == [5, 6, 2, 3]  # up to what is known
    look.append(4)  # "2 3 4" occurred at the start: followed by 9
    assert look.propose(3) == [9, 2, 3]
    assert PromptLookup([1, 2, 3]).propose(2) == []  # 3 never occurred before the end
    assert look.propose(0) == []


def test_the_bulk_index_is_the_one_appending_builds():
    rng = torch.Generator().manual_seed(0)
    for length in (0, 1, 2, 3, 7, 40):
        ids = [int(t) for t in torch.randint(0, 5, (length,), generator=rng)]
        bulk, grown = PromptLookup(ids), PromptLookup([])
        for t in ids:
            grown.append(t)
        assert bulk._after == grown._after and bulk.ids == grown.ids
        for t in (1, 2, 1, 3):
            bulk.append(t)
            grown.append(t)
            assert bulk.propose(3) == grown.propose(3)


@pytest.fixture(scope="module", params=ARCHS)
def rag(request):
    rag = KVRag(from_model(tiny_model(request.param), tiny_tokenizer()), store="memory://", check=False)
    rag.precompute(THREE_CHUNKS, progress=False)
    return rag


def decode(rag, method="cacheblend", n=24, draft_tokens=0, context=None, **sampling):
    pre = rag.prefill(THREE_Q, THREE_IDS, method=method)
    state = DecodeState()
    cfg = DecodeConfig(max_new_tokens=n, stop_at="none", draft_tokens=draft_tokens, **sampling)
    ids = pre.segments.read_ids() if context is None else context
    text = "".join(stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state,
                                 rag.lm.max_context, (), ids))
    return state, text


@pytest.mark.parametrize("method", ["full", "cacheblend", "samkv"])
def test_right_drafts_are_served_without_forwards_and_change_no_token(rag, method):
    """Drafting from the answer itself (its tokens as the 'prompt'): nearly every draft is right."""
    plain, text = decode(rag, method)
    assert len(plain.token_ids) >= 12 and plain.forwards == len(plain.token_ids) - 1 and plain.accepted == 0
    forwards = {}
    for k in (1, 2, 4):
        drafted, drafted_text = decode(rag, method, draft_tokens=k, context=plain.token_ids)
        assert (drafted.token_ids, drafted_text) == (plain.token_ids, text)
        assert drafted.accepted >= len(plain.token_ids) // 3
        assert drafted.forwards + drafted.accepted == plain.forwards  # every step: a forward or a served draft
        forwards[k] = drafted.forwards
    # as many drafts a step as asked for, not a fixed number (an answer of one repeated token finds each
    # tail's latest occurrence one token back, with one token after it: one draft whatever is asked)
    assert forwards[4] < forwards[2] < forwards[1] or len(set(plain.token_ids)) == 1


def test_wrong_drafts_change_no_token(rag):
    """Drafting from unrelated tokens: most drafts are wrong; the answer is the same."""
    plain, text = decode(rag)
    noise = [int(t) for t in torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(3))]
    drafted, drafted_text = decode(rag, draft_tokens=2, context=noise)
    assert (drafted.token_ids, drafted_text) == (plain.token_ids, text)


def test_sampled_answers_with_a_seed_are_the_same_with_drafts(rag):
    sampling = dict(temperature=0.8, top_p=0.9, seed=5)
    plain, text = decode(rag, **sampling)
    drafted, drafted_text = decode(rag, draft_tokens=2, context=plain.token_ids, **sampling)
    assert (drafted.token_ids, drafted_text) == (plain.token_ids, text)
    assert drafted.accepted > 0


def test_each_row_of_a_multi_row_step_is_that_token_stepped_alone(rag):
    """`LeanStep.many` with rows: a token and the two after it in one forward, beside a second sequence
    of one row, against stepping them one at a time: same argmax, logits within float noise, same K/V."""
    step = lean_step(rag.lm.model)

    def buffers(method):
        pre = rag.prefill(THREE_Q, THREE_IDS, method=method)
        layers = pre.output.cache.layers
        n = layers[0].keys.shape[-2]
        room = lambda t: torch.cat([t, t.new_zeros(*t.shape[:-2], 8, t.shape[-1])], -2)  # noqa: E731
        return [(room(l.keys), room(l.values)) for l in layers], n, pre.output.next_position

    (a, na, pa), (b, nb, pb) = buffers("full"), buffers("samkv")
    alone_a = [(k.clone(), v.clone()) for k, v in a]
    alone_b = [(k.clone(), v.clone()) for k, v in b]
    toks = [40, 41, 42]
    together = step.many(torch.tensor([[t] for t in toks] + [[50]]), torch.tensor([[pa], [pa + 1], [pa + 2], [pb]]),
                         [(a, na), (b, nb)], rows=[3, 1])
    singles = [step.many(torch.tensor([[t]]), torch.tensor([[pa + i]]), [(alone_a, na + i)]) for i, t in enumerate(toks)]
    singles.append(step.many(torch.tensor([[50]]), torch.tensor([[pb]]), [(alone_b, nb)]))
    for row, want in zip(together, singles):
        torch.testing.assert_close(row, want[0], rtol=1e-4, atol=1e-4)
        assert int(row.argmax()) == int(want[0].argmax())
    for (k, v), (k1, v1) in zip(a, alone_a):
        torch.testing.assert_close(k[:, :, : na + 3], k1[:, :, : na + 3], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[:, :, : na + 3], v1[:, :, : na + 3], rtol=1e-5, atol=1e-5)


def test_no_drafts_while_others_decode(rag):
    """Drafts ride a step only when a sequence decodes alone: a batch's rows are the sequences'."""
    batcher = batcher_for(rag.lm, lean_step(rag.lm.model))
    assert batcher.drafts_allowed()
    batcher.join()
    try:
        assert batcher.drafts_allowed()  # this one alone
        batcher.join()
        assert not batcher.drafts_allowed()
        batcher.leave()
    finally:
        batcher.leave()
    results, errors = {}, []

    def work(name, k):
        try:
            results[name] = decode(rag, draft_tokens=k, n=20)[0].token_ids
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, 2)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    alone = decode(rag, draft_tokens=0, n=20)[0].token_ids
    assert all(ids == alone for ids in results.values())


def test_answer_stats_count_forwards_and_served_drafts(rag):
    ans = rag.answer(THREE_Q, THREE_IDS, method="full", max_new_tokens=20, stop_at="none")
    off = rag.answer(THREE_Q, THREE_IDS, method="full", max_new_tokens=20, stop_at="none", draft_tokens=0)
    assert ans.text == off.text
    s = ans.stats
    assert s.decode_forwards + s.draft_accepted == s.generated_tokens - 1 or s.generated_tokens < 20
    assert off.stats.draft_accepted == 0 and off.stats.decode_forwards == off.stats.generated_tokens - 1
    with pytest.raises(ValueError, match="draft_tokens"):
        DecodeConfig(draft_tokens=-1)


def test_drafts_are_on_by_default_only_for_float32_weights():
    """In bfloat16 a three-row step's rounding changed 12 of the sample's 36 answers: drafts are opt-in there."""
    assert DecodeConfig().drafts_for(torch.float32) == 2
    assert DecodeConfig().drafts_for(torch.bfloat16) == 0 and DecodeConfig().drafts_for(torch.float16) == 0
    assert DecodeConfig(draft_tokens=3).drafts_for(torch.bfloat16) == 3
    assert DecodeConfig(draft_tokens=0).drafts_for(torch.float32) == 0
    rag = KVRag(from_model(tiny_model("llama").to(torch.bfloat16), tiny_tokenizer()), store="memory://", check=False)
    rag.precompute(THREE_CHUNKS, progress=False)
    auto = rag.answer(THREE_Q, THREE_IDS, method="full", max_new_tokens=20, stop_at="none")
    assert auto.stats.draft_accepted == 0 and auto.stats.decode_forwards == auto.stats.generated_tokens - 1


@pytest.mark.smollm
def test_the_bundled_model_answers_the_sample_the_same_with_drafts(smollm):
    """Every sample question, one phrasing each, 48 tokens without a stop rule: token-identical with
    the default drafts and with none, and the drafts saved forwards."""
    from kvrag.ingest.documents import load_documents
    from kvrag.ingest.samples import sample_corpus_dir, sample_questions

    rag = KVRag(smollm, store="memory://", check=False)
    docs = load_documents([sample_corpus_dir()])
    rag.precompute(docs, progress=False)
    accepted = 0
    for q in sample_questions():
        chunks = [c for c in docs if str(c.metadata.get("source", "")).endswith(q["file"])]
        runs = [rag.answer(q["question"], chunks=chunks, max_new_tokens=48, stop_at="none", draft_tokens=k) for k in (0, 2)]
        assert runs[1].text == runs[0].text, q["question"]
        assert runs[0].stats.draft_accepted == 0
        accepted += runs[1].stats.draft_accepted
    assert accepted > 0
