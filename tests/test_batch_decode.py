"""Issue #35 item 1: concurrent answers decode together, one forward a step for all of them, and each
answer is token-for-token what it is alone (greedy, and sampled with a seed); a sequence that stops
(or is abandoned) leaves the batch at once."""

import threading

import pytest
import torch

from kvrag import Chunk, KVRag, from_model
from kvrag.decode.batch import batcher_for
from kvrag.decode.lean import lean_step
from kvrag.decode.stream import DecodeConfig, DecodeState, stream_tokens
from tiny import ARCHS, THREE_CHUNKS, THREE_IDS, THREE_Q, tiny_model, tiny_tokenizer

JOBS = [  # (method, question, max_new_tokens, sampling)
    ("full", THREE_Q, 20, {}),
    ("cacheblend", "What is in the second document?", 14, {}),
    ("samkv", THREE_Q, 26, {}),
    ("reuse", "Name every document.", 9, dict(temperature=0.9, top_p=0.9, seed=11)),
]


@pytest.fixture(scope="module", params=ARCHS)
def rag(request):
    rag = KVRag(from_model(tiny_model(request.param), tiny_tokenizer()), store="memory://", check=False)
    rag.precompute(THREE_CHUNKS, progress=False)
    return rag


def decode(rag, method, question, n, sampling, barrier=None):
    pre = rag.prefill(question, THREE_IDS, method=method)
    if barrier is not None:
        barrier.wait(30)
    state = DecodeState()
    cfg = DecodeConfig(max_new_tokens=n, stop_at="none", **sampling)
    text = "".join(stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, rag.lm.max_context))
    return state.token_ids, text


def concurrently(fn, jobs):
    results, errors = [None] * len(jobs), []
    barrier = threading.Barrier(len(jobs))

    def work(i, job):
        try:
            results[i] = fn(*job, barrier=barrier)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def test_concurrent_answers_decode_together_and_as_they_do_alone(rag):
    alone = [decode(rag, *job) for job in JOBS]
    batcher = batcher_for(rag.lm, lean_step(rag.lm.model))
    before = batcher.stats.largest, batcher.stats.steps
    together = concurrently(lambda *job, barrier: decode(rag, *job, barrier=barrier), JOBS)
    assert together == alone  # every answer's tokens and text, greedy and sampled
    assert batcher.stats.largest >= 2 and batcher.stats.steps > before[1]  # they did share forwards
    assert batcher._open == 0  # each left when it ended


def test_many_rows_give_each_sequence_its_own_logits(rag):
    """`LeanStep.many` against each sequence stepped alone: same argmax, logits within float noise."""
    step = lean_step(rag.lm.model)
    seqs = []
    for method in ("full", "samkv", "cacheblend"):
        pre = rag.prefill(THREE_Q, THREE_IDS, method=method)
        layers = pre.output.cache.layers
        n = layers[0].keys.shape[-2]
        bufs = [(torch.cat([l.keys, l.keys.new_zeros(*l.keys.shape[:-2], 8, l.keys.shape[-1])], -2),
                 torch.cat([l.values, l.values.new_zeros(*l.values.shape[:-2], 8, l.values.shape[-1])], -2)) for l in layers]
        seqs.append((bufs, n, pre.output.next_position))
    copies = [([(k.clone(), v.clone()) for k, v in b], n, p) for b, n, p in seqs]
    for i in range(4):
        tokens = torch.tensor([[7 + i], [30 + i], [90 + i]])
        positions = torch.tensor([[p + i] for _, _, p in seqs])
        together = step.many(tokens, positions, [(b, n + i) for b, n, _ in seqs])
        for row, (b, n, p) in enumerate(copies):
            alone = step.many(tokens[row : row + 1], positions[row : row + 1], [(b, n + i)])[0]
            torch.testing.assert_close(together[row], alone, rtol=1e-5, atol=1e-5)
            assert int(together[row].argmax()) == int(alone.argmax())


def test_an_abandoned_stream_leaves_the_batch(rag):
    batcher = batcher_for(rag.lm, lean_step(rag.lm.model))
    pre = rag.prefill(THREE_Q, THREE_IDS, method="reuse")
    stream = stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position,
                           DecodeConfig(max_new_tokens=50, stop_at="none"), DecodeState(), rag.lm.max_context)
    for _ in range(3):
        next(stream)
    assert batcher._open == 1
    stream.close()  # what a dropped client's generator cleanup does
    assert batcher._open == 0


@pytest.mark.smollm
def test_the_bundled_model_answers_four_concurrent_requests_as_it_answers_each_alone(smollm):
    """Four concurrent requests of different methods and lengths through the engine: each answer is
    token-for-token the one it gets alone."""
    rag = KVRag(smollm, store="memory://", check=False)
    chunks = [
        Chunk("eiffel", "The Eiffel Tower is a wrought-iron tower in Paris, the capital of France. It was designed by "
              "Gustave Eiffel's company and completed in 1889 for the World's Fair.", "Eiffel Tower"),
        Chunk("fuji", "Mount Fuji is the highest mountain in Japan at 3,776 metres. It last erupted in 1707.", "Mount Fuji"),
        Chunk("wall", "The Great Wall of China stretches over 21,000 kilometres; its best-known parts were built "
              "during the Ming dynasty.", "Great Wall"),
    ]
    rag.precompute(chunks, progress=False)
    jobs = [
        ("full", "In which year was the Eiffel Tower completed?", 24),
        ("cacheblend", "How high is Mount Fuji?", 40),
        ("reuse", "Describe the Great Wall of China.", 32),
        ("samkv", "When did Mount Fuji last erupt?", 16),
    ]

    def ask(method, question, n, barrier=None):
        if barrier is not None:
            barrier.wait(60)
        return rag.answer(question, chunks=chunks, method=method, max_new_tokens=n, stop_at="none").text

    alone = [ask(*job) for job in jobs]
    batcher = batcher_for(rag.lm, lean_step(rag.lm.model))
    largest = batcher.stats.largest
    together = concurrently(ask, jobs)
    assert together == alone
    assert batcher.stats.largest >= 2 or largest >= 2


def test_the_batched_step_timer_times_every_size_over_its_own_buffers(rag):
    """kvrag.eval.decode_speed.batched_step_ms (the server benchmark's decode ceiling: the slot pool's
    step, kvrag.decode.graphs): a positive median for every size asked, on any supported architecture,
    and nothing written to the model."""
    from kvrag.eval.decode_speed import batched_step_ms

    before = {k: v.clone() for k, v in rag.lm.model.state_dict().items()}
    ms = batched_step_ms(rag.lm.model, 24, sizes=(1, 3), repeats=2)
    assert set(ms) == {1, 3} and all(v > 0 for v in ms.values())
    assert all(torch.equal(v, before[k]) for k, v in rag.lm.model.state_dict().items())


def test_the_server_benchmark_states_its_ceilings_from_its_own_figures():
    """scripts/server_bench.py: latency / prefill at 1 client bounds any number of clients; 8 x the one-row
    step / the eight-row step bounds eight answers decoding together; no 1-client level, no ceiling."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "server_bench.py"
    spec = importlib.util.spec_from_file_location("server_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    one = {"clients": 1, "latency_p50_s": 1.0, "engine_ttft_p50_s": 0.5, "prompt_tokens_p50": 580}
    got = mod.ceilings([one, {**one, "clients": 8}], {1: 36.0, 8: 90.0})
    assert got["prefill_bound_x"] == 2.0 and got["decode_bound_8_x"] == 3.2
    assert "decode_bound_8_x" not in mod.ceilings([one], {})
    assert mod.ceilings([{**one, "clients": 2}], {1: 1.0, 8: 2.0}) is None
