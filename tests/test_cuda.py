"""The core exactness invariants on a CUDA GPU, in float32 and bfloat16 (skipped without a GPU).

Errors are relative L2 errors, ||got - want|| / ||want||, over each layer's keys or the
first-token logits. Tolerances (the reasoning and CPU measurements are in kvrag/check/checks.py):

- float32: 1e-4. Same operations in another order; tiny models measure ~1e-7 .. 1e-6 on CPU.
- bfloat16: keys 4e-2, logits 3e-2. 8 mantissa bits; a reused key is rounded twice more than an
  in-place one (RoPE stripped, stored, re-applied) and the bf16 passes round differently
  (different kernels: flash for Full Attention's causal prefill, the masked kernel for reuse),
  which lands around 1e-2; real defects measure 9e-2 .. 3.5e-1.
"""

import pytest
import torch

from kvrag import Chunk, KVRag, from_model
from kvrag.model.cache import cache_kv, empty_cache
from kvrag.check.checks import check_model
from kvrag.methods.base import Method
from kvrag.model.rope import Rotary
from tiny import ARCHS, LLAMA3_ROPE, YARN_ROPE, qa_rows, tiny_model, tiny_tokenizer, THREE_CHUNKS, THREE_IDS, THREE_Q

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {
    torch.float32: {"keys": 1e-4, "logits": 1e-4},
    torch.bfloat16: {"keys": 4e-2, "logits": 3e-2},
}
DTYPES = [torch.float32, torch.bfloat16]
ROPES = {"default": None, "llama3": LLAMA3_ROPE, "yarn": YARN_ROPE}
CHUNKS, IDS, Q = THREE_CHUNKS, THREE_IDS, THREE_Q


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))


class SelectAll(Method):
    name = "select-all"

    def select(self, ctx, budget):
        return ctx.stitched.chunk_positions()


def rel(got, want):
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm())


def cuda_lm(arch, dtype, rope=None):
    return from_model(tiny_model(arch, rope_scaling=rope).to("cuda", dtype), tiny_tokenizer())


def make_rag(arch, dtype):
    rag = KVRag(cuda_lm(arch, dtype), store="memory://", check=False)  # the invariants themselves, not the gate
    rag.precompute(CHUNKS, progress=False)
    assert rag.lm.device.type == "cuda" and rag.lm.dtype == dtype
    return rag


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_single_chunk_reuse_equals_full_on_cuda(arch, dtype):
    rag = make_rag(arch, dtype)
    full = rag.prefill(Q, ["a"], method="full")
    reuse = rag.prefill(Q, ["a"], method="reuse")
    assert reuse.stats.cache_hits == 1 and reuse.stats.recomputed_tokens == 0
    assert full.logits.device.type == "cuda"
    assert rel(reuse.logits, full.logits) <= TOL[dtype]["logits"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_recompute_ratio_one_equals_full_on_cuda(arch, dtype):
    rag = make_rag(arch, dtype)
    full = rag.prefill(Q, IDS, method="full")
    for every in (rag.prefill(Q, IDS, method=SelectAll()), rag.prefill(Q, IDS, method="epic", recompute_ratio=1.0)):
        assert every.stats.recomputed_tokens == full.segments.context_len - len(full.segments.prefix)
        assert rel(every.logits, full.logits) <= TOL[dtype]["logits"]
    if dtype == torch.float32:  # reusing several chunks without recompute is measurably not Full Attention
        assert rel(rag.prefill(Q, IDS, method="reuse").logits, full.logits) > 10 * TOL[dtype]["logits"]


def keys_at(model, ids, start):
    cache = empty_cache()
    pos = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
    return [k for k, _ in cache_kv(cache)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_rerotated_keys_equal_keys_computed_in_place_on_cuda(arch, rope, dtype):
    model = cuda_lm(arch, dtype, ROPES[rope]).model
    rot = Rotary(model)
    ids = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(0)).to("cuda")
    pos_a, pos_b = torch.arange(7, 47), torch.arange(731, 771)
    at_a, at_b = keys_at(model, ids, 7), keys_at(model, ids, 731)
    for ka, kb in zip(at_a, at_b):
        moved = rot.rotate(rot.unrotate(ka, pos_a), pos_b)
        assert moved.device.type == "cuda" and moved.dtype == dtype
        assert rel(moved, kb) <= TOL[dtype]["keys"]
    assert rel(at_a[0], at_b[0]) > 0.1  # the check can fail: unmoved keys differ


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_check_model_passes_on_cuda(arch, dtype):
    report = check_model(cuda_lm(arch, dtype))
    assert report.passed, report.table()
    assert report.device == "cuda" and report.dtype == str(dtype).removeprefix("torch.")


def test_auto_picks_cuda_and_bfloat16(tmp_path):
    folder = tmp_path / "llama"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    rag = KVRag.from_pretrained(str(folder), store="memory://")  # device="auto", dtype="auto"
    want = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert rag.lm.device.type == "cuda" and rag.lm.dtype == want
    assert rag.check_report.passed and rag.check_report.device == "cuda"
    out = rag.answer(Q, chunks=CHUNKS[:2], max_new_tokens=4)
    assert out.stats.cache_misses == 2 and out.stats.generated_tokens > 0
    again = rag.answer(Q, ["a", "b"], max_new_tokens=4)
    assert again.stats.cache_hits == 2


@pytest.mark.parametrize("mode", ["links", "lora"])
def test_kvlink_training_runs_on_cuda_and_its_adapter_serves(tmp_path, mode):
    """`kvrag train-links` on the GPU: the same recipe as on the CPU, loss finite, adapter loads and answers."""
    if mode == "lora":
        pytest.importorskip("peft")
    from kvrag.link_adapter import load_adapter
    from kvrag.train import TrainConfig, train

    lm = cuda_lm("llama", torch.float32)
    cfg = TrainConfig(out=str(tmp_path / mode), mode=mode, link_tokens=2, max_chunks=4, max_steps=3, grad_accum=1, lora_r=2,
                      store="memory://", progress=False)
    res = train(cfg, lm=lm, rows=qa_rows(3))
    assert res.steps == 3 and all(l == l and l < 1e4 for l in res.losses)  # finite
    base = KVRag(lm, store="memory://", check=False, link_adapter=None)
    adapter = load_adapter(res.adapter_path, lm, base.layout.identity)
    assert adapter.mode == mode and adapter.embeds.shape[:2] == (4, 2)
    tuned = KVRag(lm, store="memory://", check=False, link_adapter=res.adapter_path)
    ans = tuned.answer(Q, chunks=CHUNKS, method="kvlink", max_new_tokens=2)
    assert ans.stats.generated_tokens > 0 and tuned.lm.device.type == "cuda"


# -- issue #22: the static decode step captured in a CUDA graph -----------------------------------
# The CPU suite (tests/test_static_decode.py) runs the same StaticStep.run eagerly; only here is it captured.
DECODE_PREFILLS = ["full", "cacheblend", "samkv"]  # Full Attention, a reuse prefill, SamKV's sparse stitched cache
SAMPLINGS = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=7)]


def decode_mode(rag, method, mode, monkeypatch, evict=None, max_new_tokens=24, **sampling):
    """Tokens and finish reason of one decode: "growing" (the eager append path), "static" (the static
    step run eagerly on the GPU) or "graph" (the same step captured and replayed); and the decoders made."""
    import kvrag.decode.stream as decode_mod
    from kvrag.decode.stream import DecodeConfig, DecodeState, stream_tokens
    from kvrag.decode.static import StaticDecoder

    made = []

    def make(lm, cache, steps):
        made.append(StaticDecoder(lm, cache, steps, graph=mode == "graph"))
        return made[-1]

    monkeypatch.setattr(decode_mod, "StaticDecoder", make)
    pre = rag.prefill(Q, IDS, method=method, evict=evict)
    if evict is not None:
        rag.pipeline._evict(pre, evict)
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, static=mode != "growing", **sampling)
    state = DecodeState()
    for _ in stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, rag.lm.max_context):
        pass
    return (state.token_ids, state.finish_reason), made


@pytest.mark.parametrize("method", DECODE_PREFILLS)
@pytest.mark.parametrize("arch", ARCHS)
def test_graph_decode_picks_the_eager_tokens_on_cuda(arch, method, monkeypatch):
    """float32: the replayed graph, the static step run eagerly and the growing cache pick the same tokens."""
    rag = make_rag(arch, torch.float32)
    for sampling in SAMPLINGS:
        growing, _ = decode_mode(rag, method, "growing", monkeypatch, **sampling)
        static, _ = decode_mode(rag, method, "static", monkeypatch, **sampling)
        graph, made = decode_mode(rag, method, "graph", monkeypatch, **sampling)
        assert len(growing[0]) >= 8
        assert made and made[0].replays == len(graph[0]) - (graph[1] != "eos")  # every forward replayed the graph
        assert graph == static == growing


@pytest.mark.parametrize("method", DECODE_PREFILLS)
def test_graph_decode_equals_the_eager_static_step_in_bfloat16(method, monkeypatch):
    """bfloat16: the graph replays the very kernels of the eager static step, so the tokens are the same."""
    rag = make_rag("llama", torch.bfloat16)
    for sampling in SAMPLINGS:
        static, _ = decode_mode(rag, method, "static", monkeypatch, **sampling)
        graph, made = decode_mode(rag, method, "graph", monkeypatch, **sampling)
        assert made[0].replays > 0 and graph == static


def test_graph_decode_after_snapkv_grows_the_room_on_cuda(monkeypatch):
    """SnapKV's cache keeps 64 slots of room; 80 tokens make the static buffer grow once before capture."""
    from kvrag.methods.snapkv import SnapKV

    rag = make_rag("qwen2", torch.float32)
    growing, _ = decode_mode(rag, "reuse", "growing", monkeypatch, evict=SnapKV(budget=8), max_new_tokens=80)
    graph, made = decode_mode(rag, "reuse", "graph", monkeypatch, evict=SnapKV(budget=8), max_new_tokens=80)
    assert made[0].replays > 0 and graph == growing


def test_cuda_answers_use_the_graph_by_default_and_match_the_eager_answer(monkeypatch):
    import kvrag.decode.stream as decode_mod

    made, real = [], decode_mod.StaticDecoder
    monkeypatch.setattr(decode_mod, "StaticDecoder", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    rag = make_rag("llama", torch.float32)
    kw = dict(method="cacheblend", max_new_tokens=20, stop_at="none", temperature=0.7, seed=1)
    auto = rag.answer(Q, IDS, **kw)  # DecodeConfig.static=None: on for CUDA
    assert len(made) == 1 and made[0].graph and made[0].replays > 0
    eager = rag.answer(Q, IDS, static=False, **kw)
    assert len(made) == 1 and (auto.text, auto.stats.generated_tokens) == (eager.text, eager.stats.generated_tokens)


def test_concurrent_cuda_answers_leave_their_graphs_to_decode_together(monkeypatch):
    """Issue #35 on a GPU: alone, an answer replays its graph; beside others, the steps are batched
    (one forward for all), and float32 greedy answers stay what they are alone."""
    import threading

    import kvrag.decode.stream as decode_mod

    made, real = [], decode_mod.StaticDecoder
    monkeypatch.setattr(decode_mod, "StaticDecoder", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    rag = make_rag("llama", torch.float32)
    jobs = [("full", 24), ("cacheblend", 18), ("samkv", 30)]
    ask = lambda method, n: rag.answer(Q, IDS, method=method, max_new_tokens=n, stop_at="none").text
    alone = [ask(*job) for job in jobs]
    assert all(d.graph and d.replays == d.forwards > 0 for d in made)
    made.clear()
    together, barrier = [None] * len(jobs), threading.Barrier(len(jobs))

    def work(i):
        barrier.wait(60)
        together[i] = ask(*jobs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone
    assert sum(d.forwards - d.replays for d in made) > 0  # steps shared through the batcher

# -- layer-wise loading (kvrag.fuse.layer_feed): copies on a side stream, overlapped with the passes ----
LAYERWISE = [("reuse", {}), ("epic", {}), ("a3", {}), ("fusionrag", {}), ("cacheblend", {}), ("samkv", {}), ("kvlink", {"link_tokens": 2})]
STORES = {"host": "host://?pin=1", "disk": "disk://{tmp}?pin=1", "memory": "memory://"}  # pinned host, pinned reads, on the device


def layerwise_rag(dtype, url, tmp_path):
    rag = KVRag(cuda_lm("llama", dtype), store=url.format(tmp=tmp_path), check=False)
    rag.precompute(CHUNKS, progress=False)
    return rag


@pytest.mark.parametrize("store", list(STORES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layerwise_loading_gives_the_eager_logits_on_cuda(tmp_path, dtype, store):
    rag = layerwise_rag(dtype, STORES[store], tmp_path)
    assert rag.repo.layerwise is None and rag.repo.layerwise_load  # the default on CUDA
    for method, params in LAYERWISE:
        rag.repo.layerwise = False
        eager = rag.prefill(Q, IDS, method=method, recompute_ratio=0.15, **params)
        rag.repo.layerwise = None
        lw = rag.prefill(Q, IDS, method=method, recompute_ratio=0.15, **params)
        assert lw.stats.layerwise and not eager.stats.layerwise and lw.stitched.feed is None
        assert rel(lw.logits, eager.logits) <= TOL[dtype]["logits"], method
        if dtype == torch.float32:
            assert torch.equal(lw.selected.cpu(), eager.selected.cpu()), method
            assert rel(lw.stitched.keys, eager.stitched.keys) <= TOL[dtype]["keys"], method
            kw = dict(method=method, recompute_ratio=0.15, max_new_tokens=6, stop_at="none", **params)
            rag.repo.layerwise = False
            want = rag.answer(Q, IDS, **kw).text
            rag.repo.layerwise = None
            assert rag.answer(Q, IDS, **kw).text == want, method


@pytest.mark.parametrize("store", ["host", "disk"])
def test_layerwise_copies_are_non_blocking_from_pinned_memory(tmp_path, monkeypatch, store):
    from kvrag.fuse.layer_feed import LayerFeed

    rag = layerwise_rag(torch.bfloat16, STORES[store], tmp_path)
    rag.prefill(Q, IDS, method="cacheblend")  # warm: the prefix exists, the entries are stored
    copies, feeds = [], []
    real_copy, real_init = torch.Tensor.copy_, LayerFeed.__init__

    def spy(self, src, non_blocking=False):
        if self.device.type == "cuda" and src.device.type == "cpu":
            copies.append((non_blocking, src.is_pinned()))
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    monkeypatch.setattr(LayerFeed, "__init__", lambda self, *a, **k: (feeds.append(self), real_init(self, *a, **k))[1])
    pre = rag.prefill(Q, IDS, method="cacheblend")
    monkeypatch.undo()
    layers = rag.lm.config.num_hidden_layers
    assert len(copies) == 2 * layers * len(IDS)  # keys and values of every chunk, layer by layer
    assert all(non_blocking and pinned for non_blocking, pinned in copies), copies
    feed = feeds[0]
    assert feed.cuda and feed.order == list(range(layers)) and feed.complete
    # the copy work, and the part of it the passes waited for (never more than the work itself)
    assert pre.stats.layer_load_s > 0 and 0 <= pre.stats.load_wait_s <= pre.stats.layer_load_s + 1e-3


def test_layerwise_layers_are_ensured_before_their_attention_on_cuda(tmp_path, monkeypatch):
    from kvrag.fuse.layer_feed import LayerFeed
    from kvrag.model.loading import decoder_of

    rag = layerwise_rag(torch.float32, STORES["host"], tmp_path)
    events = []
    ensure = LayerFeed.ensure
    monkeypatch.setattr(LayerFeed, "ensure", lambda self, i: (events.append(("ensure", i)), ensure(self, i))[1])
    hooks = [l.self_attn.register_forward_hook(lambda m, a, o, i=i: events.append(("attn", i))) for i, l in enumerate(decoder_of(rag.lm.model).layers)]
    try:
        rag.prefill(Q, IDS, method="reuse")
    finally:
        for h in hooks:
            h.remove()
    layers = rag.lm.config.num_hidden_layers
    for i in range(layers):
        assert events.index(("ensure", i)) < events.index(("attn", i))
