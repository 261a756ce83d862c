"""Issue #60 on the CPU: the pooled decode step (kvrag.decode.pool, kvrag.decode.graphs) that CUDA graphs
replay, one per (row bucket, span), run here eagerly over the same buffers and inputs.

What a graph needs and the CPU can check: no host sync inside a step (torch.profiler finds no
`aten::item`, `_local_scalar_dense` or `nonzero`), and every input the step reads keeps its address
from one step to the next, also while sequences join and leave. What users need: greedy answers of
sequences batched in the pool, joining and leaving at different times (and missing a step), are
token for token those of the growing-cache decode, and each cache reads as decoded afterwards.
"""

import threading

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvrag import KVRag, from_model
from kvrag.decode.attend import attend_rows, key_splits
from kvrag.decode.batch import Call, batcher_for
from kvrag.decode.graphs import PooledStep
from kvrag.decode.lean import lean_step
from kvrag.decode.pool import SlotPool, row_bucket, span_bucket
from kvrag.decode.static import StaticDecoder
from kvrag.decode.stream import DecodeConfig, DecodeState, eos_ids, stream_tokens
from kvrag.model.cache import cache_kv, cache_len
from tiny import ARCHS, THREE_CHUNKS, THREE_IDS, THREE_Q, tiny_model, tiny_tokenizer

# (method, question, new tokens, the step it joins at): contexts and answers of different lengths
JOBS = [
    ("full", THREE_Q, 12, 0),
    ("cacheblend", "What is in the second document?", 7, 0),
    ("samkv", THREE_Q, 15, 2),
    ("reuse", "Name every document.", 9, 3),
    ("full", "Which markets rose today?", 5, 6),
]
BANNED = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero")


@pytest.fixture(scope="module", params=ARCHS)
def rag(request):
    rag = KVRag(from_model(tiny_model(request.param), tiny_tokenizer()), store="memory://", check=False)
    rag.precompute(THREE_CHUNKS, progress=False)
    return rag


def batcher(rag):
    return batcher_for(rag.lm, lean_step(rag.lm.model))


def growing(rag, method, question, n):
    """The reference: the stock forward appending to the growing cache. Tokens, and the cache after."""
    pre = rag.prefill(question, THREE_IDS, method=method)
    state = DecodeState()
    cfg = DecodeConfig(max_new_tokens=n, stop_at="none", static=False)
    for _ in stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, rag.lm.max_context):
        pass
    return state.token_ids, cache_kv(pre.output.cache)


class Seq:
    """One answer driven by hand through the pooled step: its decoder holds its row of the pool."""

    def __init__(self, rag, method, question, n):
        self.pre = rag.prefill(question, THREE_IDS, method=method)
        self.dec = StaticDecoder(rag.lm, self.pre.output.cache, steps=n, graph=False)
        assert self.dec.seated
        self.n, self.eos = n, eos_ids(rag.lm)
        self.tokens, self.pos, self.done = [], self.pre.output.next_position, False
        self.take(self.pre.logits)

    def take(self, logits):
        token = int(logits.argmax())
        if token in self.eos or len(self.tokens) == self.n:
            self.finish()
            return
        self.tokens.append(token)
        if len(self.tokens) == self.n:
            self.finish()

    def feed(self):
        return (self.dec._seat, self.tokens[-1], self.pos, self.dec.start + self.dec.written)

    def advance(self, logits):
        self.dec.written += 1
        self.pos += 1
        self.take(logits)

    def finish(self):
        if not self.done:
            self.done = True
            self.dec.close()


def schedule(rag, jobs, skip=(), graph=False):
    """Step the jobs together through the pool, each joining at its step; (job, step) in `skip`: that
    sequence hands no token at that step (its row idles). Returns the Seqs and the (rows, pool rows) stepped."""
    pooled_of = lambda: batcher(rag).pooled  # noqa: E731 - made at the first seat
    seqs, live, shapes, t = [None] * len(jobs), [], [], 0
    while t < 100 and (any(s is None for s in seqs) or live):
        for i, (method, question, n, join) in enumerate(jobs):
            if join == t:
                seqs[i] = Seq(rag, method, question, n)
                if not seqs[i].done:
                    live.append(seqs[i])
        fed = [s for s in live if (seqs.index(s), t) not in skip]
        if fed:
            pooled = pooled_of()
            out, replayed, _ = pooled.run([s.feed() for s in fed], graph=graph)
            assert replayed == graph
            shapes.append((out.shape[0], pooled.pool.inputs.shape[0]))
            rows = [out[s.dec._seat.row] for s in fed]
            for s, logits in zip(fed, rows):
                s.advance(logits)
        live = [s for s in live if not s.done]
        t += 1
    return seqs, shapes


def test_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert [span_bucket(n) for n in (1, 256, 257, 1024, 1025, 1300, 2049, 8583, 16724, 33391)] == [
        256, 256, 512, 1024, 1280, 1536, 2560, 10240, 20480, 40960]
    assert all(span_bucket(n) % 256 == 0 and n <= span_bucket(n) <= max(n + 255, 1.25 * n) for n in range(1, 40000, 97))
    assert key_splits(8, 8, 8192, torch.device("cpu")) == 1


def test_rows_move_down_when_a_sequence_leaves_and_its_answer_goes_back():
    """The pool's bookkeeping on plain tensors: a context copied into its row, rows kept 0..n-1 (the last
    moves into a freed row, K/V and all), an answer's slots copied back, the reserved rows made at once,
    a step's inputs (idle rows write the scratch slot), and growth that bumps the generation."""
    pool = SlotPool(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu", min_rows=3)

    def kv(fill, n):
        return [(torch.full((1, 2, n + 8, 4), fill + layer), torch.full((1, 2, n + 8, 4), -fill - layer)) for layer in range(2)]

    a, b, c = (pool.seat(kv(f, n), n, n + 8) for f, n in ((1.0, 5), (10.0, 7), (20.0, 3)))
    assert (pool.rows, pool.capacity, pool.generation) == (4, 256, 1) and [s.row for s in (a, b, c)] == [0, 1, 2]
    assert pool.k[1][1, :, :7].eq(11.0).all() and pool.k[1][1, :, 7:].eq(0).all()
    rows, span = pool.set_inputs([(a, 7, 40, 5), (c, 9, 30, 3)])  # b idles
    assert (rows, span) == (4, 256) and pool.inputs.tolist() == [[7, 40, 5], [0, 0, 255], [9, 30, 3], [0, 0, 255]]
    pool.k[0][2, :, 3] = 99.0  # c's answer slot, as a step writes it
    out = kv(0.0, 3)
    pool.release(a)
    assert pool.seats == [c, b] and (c.row, b.row) == (0, 1)
    assert pool.k[0][0, :, 3].eq(99.0).all() and pool.k[0][0, :, :3].eq(20.0).all()  # c moved into row 0 whole
    pool.release(c, out)
    assert out[0][0][0, :, 3].eq(99.0).all() and out[0][0][0, :, :3].eq(0.0).all()  # only its answer's slots came back
    assert pool.seats == [b] and b.row == 0 and pool.k[1][0, :, :7].eq(11.0).all()  # b moved down
    with pytest.raises(RuntimeError, match="outside"):
        pool.set_inputs([(b, 1, 1, 2)])  # inside its context: never written by a step
    pool.seat(kv(5.0, 300), 300, 310)  # longer than the capacity: reallocated, b's rows kept
    assert (pool.capacity, pool.generation) == (512, 2) and pool.k[1][0, :, :7].eq(11.0).all()
    assert not pool.clear() and not pool.fits(kv(1.0, 3), 0)


def test_batched_greedy_answers_are_the_lone_answers_as_sequences_join_leave_and_idle(rag):
    """Five answers of different contexts and lengths join at steps 0, 0, 2, 3 and 6 and leave as they end
    (rows move), one misses two steps: each is token for token the growing-cache answer, and its cache
    afterwards holds the answer's K/V (copied back from its row, wherever it moved)."""
    want = [growing(rag, m, q, n) for m, q, n, _ in JOBS]
    seqs, shapes = schedule(rag, JOBS, skip={(0, 4), (2, 5)})
    assert [s.tokens for s in seqs] == [w[0] for w in want]
    assert any(rows >= 4 for rows, _ in shapes) and any(rows == 1 for rows, _ in shapes)  # batched and alone
    for s, (_, kv) in zip(seqs, want):
        assert cache_len(s.pre.output.cache) == kv[0][0].shape[-2]  # every fed token, as the growing cache holds
        for (k, v), (k0, v0) in zip(cache_kv(s.pre.output.cache), kv):
            torch.testing.assert_close(k, k0, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, v0, rtol=1e-4, atol=1e-4)
    assert not batcher(rag).pooled.pool.seats and batcher(rag)._open == 0  # every row given back


def test_the_step_inputs_keep_their_addresses_while_sequences_join_and_leave(rag, monkeypatch):
    """What a graph replays reads fixed addresses: every tensor the step reads (tokens, positions, slots
    written, the span's slot indices, every layer's K/V) is at the same address at every step, one
    sequence or several, as they join and leave; nothing is reallocated (the pool's generation)."""
    b = batcher(rag)
    warm = [Seq(rag, "full", THREE_Q, 40) for _ in range(4)]  # size the pool: 4 rows, room for the longest
    for s in warm:
        s.finish()
    pooled = b.pooled
    generation, seen = pooled.pool.generation, []
    real = pooled.step.rows

    def spy(tokens, positions, buffers, write, slots, splits=1):
        seen.append((tokens.data_ptr(), positions.data_ptr(), write.data_ptr(), slots.data_ptr(),
                     tuple(t.data_ptr() for kv in buffers for t in kv)))
        return real(tokens, positions, buffers, write, slots, splits)

    monkeypatch.setattr(pooled.step, "rows", spy)
    jobs = [(m, q, n, j) for m, q, n, j in JOBS[:4]]
    seqs, shapes = schedule(rag, jobs)
    assert {rows for rows, _ in shapes} >= {1, 4} and all(s.done for s in seqs)
    assert len(seen) == len(shapes) and len(set(seen)) == 1
    assert pooled.pool.generation == generation and b.pooled is pooled


def ops_of(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


def test_a_single_and_a_batched_step_make_no_host_sync(rag):
    """torch.profiler over one step (the batcher's whole step: inputs copied in, the pooled step, the
    logits handed out), alone and for three sequences beside an idle row: no item, no
    _local_scalar_dense, no nonzero (each a host sync on a GPU, and a capture failure)."""
    b = batcher(rag)
    seqs = [Seq(rag, m, q, 20) for m, q, _, _ in JOBS[:4]]
    try:
        layers = len(rag.lm.model.model.layers)
        for group in ([seqs[0]], seqs[:2] + seqs[3:]):  # one; three of four (seqs[2]'s row idles)
            group = [s for s in group if not s.done]
            calls = [Call(s.dec._seat, [s.tokens[-1]], s.pos, s.dec.start + s.dec.written) for s in group]
            ops = ops_of(lambda: b._run(calls))
            assert all(c.error is None and c.logits is not None for c in calls)
            assert ops.get("aten::index_put_", 0) == 2 * layers  # the step ran: K and V written once a layer
            assert not {op: n for op, n in ops.items() if op in BANNED}
            for s, c in zip(group, calls):
                s.advance(c.logits[0])
    finally:
        for s in seqs:
            if not s.done:
                s.finish()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_attention_split_along_the_keys_is_one_product(dtype, tol):
    """The flash-decoding split (blocks of keys summed in float32) against one product, for several rows
    with their own hidden room, grouped heads; and both against SDPA over K/V repeated per head."""
    torch.manual_seed(0)
    rows, heads, kv_heads, d, S = 3, 8, 2, 16, 512
    q = torch.randn(rows, heads, 1, d, dtype=dtype)
    k, v = torch.randn(rows, kv_heads, S, d, dtype=dtype), torch.randn(rows, kv_heads, S, d, dtype=dtype)
    used = torch.tensor([100, 512, 333])
    bias = torch.zeros(rows, 1, 1, S, dtype=dtype).masked_fill_((torch.arange(S)[None] >= used[:, None])[:, None, None], torch.finfo(dtype).min)
    one = attend_rows(q, k, v, bias, d**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(heads // kv_heads, 1), v.float().repeat_interleave(heads // kv_heads, 1),
        attn_mask=bias.float(), scale=d**-0.5).transpose(1, 2)
    torch.testing.assert_close(one.float(), ref, rtol=tol, atol=tol)
    for splits in (2, 4):
        torch.testing.assert_close(attend_rows(q, k, v, bias, d**-0.5, splits).float(), one.float(), rtol=tol, atol=tol)


def test_the_split_step_picks_the_same_tokens(rag, monkeypatch):
    """The pooled step with its keys split (as on a GPU) decodes the same greedy answers."""
    import kvrag.decode.graphs as graphs

    monkeypatch.setattr(graphs, "key_splits", lambda rows, kv, span, device: 4)
    want = [growing(rag, m, q, n)[0] for m, q, n, _ in JOBS[:3]]
    seqs, _ = schedule(rag, JOBS[:3])
    assert [s.tokens for s in seqs] == want


class FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the captured region into its output."""

    def __init__(self, pooled, key):
        self.pooled, self.key = pooled, key
        self.out = pooled.region(*key)

    def replay(self):
        self.out.copy_(self.pooled.region(*self.key))


@pytest.fixture
def fake_graphs(monkeypatch):
    """Captures stood in for on the CPU (FakeGraph); the keys captured, in order."""
    captured = []

    def capture(self, key):
        captured.append(key)
        g = FakeGraph(self, key)
        return g, g.out

    monkeypatch.setattr(PooledStep, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    return captured


def test_sequences_join_and_leave_without_a_capture(rag, fake_graphs):
    """With graphs (stood in for on the CPU) every step replays the graph of its (rows, span), captured
    when a step first needs it (and again after the pool grew: 2, then 4, then 8 rows); the same answers
    joining and leaving again reallocate nothing and capture only what the grown pool had not seen yet;
    a third time nothing at all."""
    b = batcher(rag)
    b.clear()
    want = [growing(rag, m, q, n)[0] for m, q, n, _ in JOBS]
    seqs, shapes = schedule(rag, JOBS, skip={(1, 3)}, graph=True)
    assert [s.tokens for s in seqs] == want
    first = list(fake_graphs)
    assert {rows for rows, _, _ in first} >= {1, 8} and len(first) <= len(set(first)) + 2  # two growths after the first
    generation = b.pooled.pool.generation
    seqs, _ = schedule(rag, JOBS, skip={(1, 3)}, graph=True)
    second = fake_graphs[len(first):]
    assert [s.tokens for s in seqs] == want and b.pooled.pool.generation == generation
    grown = next(i for i, (rows, _, _) in enumerate(first) if rows == 8)  # the first capture once the pool had 8 rows
    assert len(set(second)) == len(second) and not set(second) & set(first[grown:])
    seqs, _ = schedule(rag, JOBS, skip={(1, 3)}, graph=True)
    assert [s.tokens for s in seqs] == want and len(fake_graphs) == len(first) + len(second)


def test_concurrent_answers_replay_graphs_alone_and_together(rag, fake_graphs, monkeypatch):
    """Through the engine's own decode loop and the batcher (threads): alone and together every forward
    of a graph decoder replays a graph, and concurrent answers are their lone answers."""
    made = []
    init = StaticDecoder.__init__

    def graphed(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "graph": True})
        made.append(self)

    monkeypatch.setattr(StaticDecoder, "__init__", graphed)
    jobs = JOBS[:4]

    def answer(method, question, n, _join, barrier=None):
        pre = rag.prefill(question, THREE_IDS, method=method)
        if barrier is not None:
            barrier.wait(30)
        state = DecodeState()
        cfg = DecodeConfig(max_new_tokens=n, stop_at="none")
        for _ in stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, rag.lm.max_context):
            pass
        return state.token_ids

    alone = [answer(*job) for job in jobs]
    assert [growing(rag, m, q, n)[0] for m, q, n, _ in jobs] == alone
    assert all(d.seated and d.draft_tokens == 0 and d.replays == d.forwards > 0 for d in made)
    made.clear()
    largest = batcher(rag).stats.largest
    results, barrier = [None] * len(jobs), threading.Barrier(len(jobs))
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, answer(*jobs[i], barrier=barrier))) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == alone
    assert all(d.replays == d.forwards > 0 for d in made)
    assert batcher(rag).stats.largest >= 2 or largest >= 2


def test_a_server_makes_its_concurrency_s_rows_at_once(rag):
    """create_app reserves the pool's rows for its max_concurrency: the first answers that decode
    together do not grow the pool (on a GPU each growth drops the captured graphs)."""
    from kvrag.server import ServerSettings, create_app

    b = batcher(rag)
    b.clear()
    create_app(rag, ServerSettings(max_concurrency=3))
    s = Seq(rag, "full", THREE_Q, 4)
    try:
        assert b.pooled.pool.rows == 4 and b.pooled.pool.generation == 1
    finally:
        s.finish()
        b.reserve(1)
