"""The core exactness invariants on every device here, in float32 and bfloat16: the CPU always, a CUDA
GPU when there is one (tests/devices.py). The helpers take the device, so CI (no GPU) runs the very
calls the GPU runs: a signature change that breaks a CUDA test breaks its CPU run too. What only CUDA
has (the decode step replayed from a CUDA graph, pinned host memory, copies on a side stream) is asserted
on CUDA; on the CPU the same call runs what the CPU does instead (graph=False, unpinned, fills in line).

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

from devices import CUDA, DEVICES, on_devices
from kvrag import Chunk, KVRag, from_model
from kvrag.model.cache import cache_kv, empty_cache
from kvrag.check.checks import check_model
from kvrag.methods.base import Method
from kvrag.model.rope import Rotary
from tiny import ARCHS, LLAMA3_ROPE, YARN_ROPE, qa_rows, tiny_model, tiny_tokenizer, THREE_CHUNKS, THREE_IDS, THREE_Q

TOL = {
    torch.float32: {"keys": 1e-4, "logits": 1e-4},
    torch.bfloat16: {"keys": 4e-2, "logits": 3e-2},
}
DTYPES = [torch.float32, torch.bfloat16]
ROPES = {"default": None, "llama3": LLAMA3_ROPE, "yarn": YARN_ROPE}
CHUNKS, IDS, Q = THREE_CHUNKS, THREE_IDS, THREE_Q
on_every_device = pytest.mark.parametrize("device", DEVICES)
ARCH_DTYPES = [(a, d) for a in ARCHS for d in DTYPES]
CPU_ARCH_DTYPES = [("llama", torch.float32), ("qwen3", torch.bfloat16)]  # the CPU's matrix is in test_methods, test_rope, test_check_model


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


def device_lm(device, arch, dtype, rope=None):
    return from_model(tiny_model(arch, rope_scaling=rope).to(device, dtype), tiny_tokenizer())


def make_rag(device, arch, dtype):
    rag = KVRag(device_lm(device, arch, dtype), store="memory://", check=False)  # the invariants themselves, not the gate
    rag.precompute(CHUNKS, progress=False)
    assert rag.lm.device.type == device and rag.lm.dtype == dtype
    return rag


@on_devices("arch, dtype", ARCH_DTYPES, cpu=CPU_ARCH_DTYPES)
def test_single_chunk_reuse_equals_full(device, arch, dtype):
    rag = make_rag(device, arch, dtype)
    full = rag.prefill(Q, ["a"], method="full")
    reuse = rag.prefill(Q, ["a"], method="reuse")
    assert reuse.stats.cache_hits == 1 and reuse.stats.recomputed_tokens == 0
    assert full.logits.device.type == device
    assert rel(reuse.logits, full.logits) <= TOL[dtype]["logits"]


@on_devices("arch, dtype", ARCH_DTYPES, cpu=CPU_ARCH_DTYPES)
def test_recompute_ratio_one_equals_full(device, arch, dtype):
    rag = make_rag(device, arch, dtype)
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


@on_devices("arch, rope, dtype", [(a, r, d) for a in ARCHS for r in ROPES for d in DTYPES], cpu=[("llama", r, d) for r in ROPES for d in DTYPES])
def test_rerotated_keys_equal_keys_computed_in_place(device, arch, rope, dtype):
    model = device_lm(device, arch, dtype, ROPES[rope]).model
    rot = Rotary(model)
    ids = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(0)).to(device)
    pos_a, pos_b = torch.arange(7, 47), torch.arange(731, 771)
    at_a, at_b = keys_at(model, ids, 7), keys_at(model, ids, 731)
    for ka, kb in zip(at_a, at_b):
        moved = rot.rotate(rot.unrotate(ka, pos_a), pos_b)
        assert moved.device.type == device and moved.dtype == dtype
        assert rel(moved, kb) <= TOL[dtype]["keys"]
    assert rel(at_a[0], at_b[0]) > 0.1  # the check can fail: unmoved keys differ


@on_devices("arch, dtype", ARCH_DTYPES, cpu=[("llama", torch.float32)])  # tests/test_check_model.py: the CPU in depth
def test_check_model_passes(device, arch, dtype):
    report = check_model(device_lm(device, arch, dtype))
    assert report.passed, report.table()
    assert report.device == device and report.dtype == str(dtype).removeprefix("torch.")


def test_auto_picks_the_device_and_its_dtype(tmp_path):
    """device="auto", dtype="auto": CUDA in bfloat16 (float16 without bf16) where there is a GPU, else the CPU in float32."""
    folder = tmp_path / "llama"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    rag = KVRag.from_pretrained(str(folder), store="memory://")  # device="auto", dtype="auto"
    if CUDA:
        want = ("cuda", torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    else:
        want = ("cpu", torch.float32)
    assert (rag.lm.device.type, rag.lm.dtype) == want
    assert rag.check_report.passed and rag.check_report.device == want[0]
    out = rag.answer(Q, chunks=CHUNKS[:2], max_new_tokens=4)
    assert out.stats.cache_misses == 2 and out.stats.generated_tokens > 0
    again = rag.answer(Q, ["a", "b"], max_new_tokens=4)
    assert again.stats.cache_hits == 2


@pytest.mark.parametrize("mode", ["links", "lora"])
@on_every_device
def test_kvlink_training_runs_and_its_adapter_serves(tmp_path, device, mode):
    """`kvrag train-links` on the device: the same recipe everywhere, loss finite, adapter loads and answers."""
    if mode == "lora":
        pytest.importorskip("peft")
    from kvrag.link_adapter import load_adapter
    from kvrag.train import TrainConfig, train

    lm = device_lm(device, "llama", torch.float32)
    cfg = TrainConfig(out=str(tmp_path / mode), mode=mode, link_tokens=2, max_chunks=4, max_steps=3, grad_accum=1, lora_r=2,
                      store="memory://", progress=False)
    res = train(cfg, lm=lm, rows=qa_rows(3))
    assert res.steps == 3 and all(l == l and l < 1e4 for l in res.losses)  # finite
    base = KVRag(lm, store="memory://", check=False, link_adapter=None)
    adapter = load_adapter(res.adapter_path, lm, base.layout.identity)
    assert adapter.mode == mode and adapter.embeds.shape[:2] == (4, 2)
    tuned = KVRag(lm, store="memory://", check=False, link_adapter=res.adapter_path)
    ans = tuned.answer(Q, chunks=CHUNKS, method="kvlink", max_new_tokens=2)
    assert ans.stats.generated_tokens > 0 and tuned.lm.device.type == device


# -- issue #22: the static decode step, captured in a CUDA graph on CUDA ---------------------------
# On the CPU the same helper runs the static step eagerly (graph=False): tests/test_static_decode.py
# checks that step in depth; here it proves the helper still fits how kvrag.decode.stream calls it.
DECODE_PREFILLS = ["full", "cacheblend", "samkv"]  # Full Attention, a reuse prefill, SamKV's sparse stitched cache
SAMPLINGS = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=7)]


def modes_on(device):
    """The decode paths `device` has: the growing cache, the static step run eagerly and (CUDA) replayed from a graph."""
    return ["growing", "static"] + (["graph"] if device == "cuda" else [])


def decode_mode(rag, method, mode, monkeypatch, evict=None, max_new_tokens=24, **sampling):
    """Tokens and finish reason of one decode: "growing" (the eager append path), "static" (the static
    step run eagerly) or "graph" (the same step captured and replayed; CUDA only); and the decoders made.
    The factory takes StaticDecoder's place in kvrag.decode.stream and passes on whatever that module
    calls it with, setting only `graph`; drafts are off, so "static" runs the very step a graph captures."""
    import kvrag.decode.stream as decode_mod
    from kvrag.decode.stream import DecodeConfig, DecodeState, stream_tokens
    from kvrag.decode.static import StaticDecoder

    made = []

    def make(*args, **kwargs):
        made.append(StaticDecoder(*args, **{**kwargs, "graph": mode == "graph"}))
        return made[-1]

    monkeypatch.setattr(decode_mod, "StaticDecoder", make)
    pre = rag.prefill(Q, IDS, method=method, evict=evict)
    if evict is not None:
        rag.pipeline._evict(pre, evict)
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, static=mode != "growing", draft_tokens=0, **sampling)
    state = DecodeState()
    for _ in stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, rag.lm.max_context):
        pass
    return (state.token_ids, state.finish_reason), made


def check_made(mode, got, made):
    """One decoder per static decode, its forwards one per token after the first, all replayed from the graph in "graph"."""
    if mode == "growing":
        assert made == []
        return
    assert len(made) == 1 and made[0].graph == (mode == "graph")  # a failed capture falls back: graph False
    assert made[0].forwards == len(got[0]) - (got[1] != "eos") > 0
    assert made[0].replays == (made[0].forwards if mode == "graph" else 0)  # the graph served every step


@on_devices("arch, method", [(a, m) for a in ARCHS for m in DECODE_PREFILLS], cpu=[("llama", "samkv")])
def test_static_and_graph_decode_pick_the_growing_cache_tokens(device, arch, method, monkeypatch):
    """float32: the growing cache, the static step run eagerly and (CUDA) the replayed graph pick the same tokens."""
    rag = make_rag(device, arch, torch.float32)
    for sampling in SAMPLINGS:
        runs = {mode: decode_mode(rag, method, mode, monkeypatch, **sampling) for mode in modes_on(device)}
        growing = runs["growing"][0]
        assert len(growing[0]) >= 8
        for mode, (got, made) in runs.items():
            check_made(mode, got, made)
            assert got == growing, mode


@on_devices("method", DECODE_PREFILLS, cpu=["samkv"])
def test_graph_decode_equals_the_eager_static_step_in_bfloat16(device, method, monkeypatch):
    """bfloat16: the graph replays the very kernels of the eager static step, so the tokens are the same."""
    rag = make_rag(device, "llama", torch.bfloat16)
    for sampling in SAMPLINGS:
        runs = {mode: decode_mode(rag, method, mode, monkeypatch, **sampling) for mode in modes_on(device)[1:]}
        for mode, (got, made) in runs.items():
            check_made(mode, got, made)
            assert got == runs["static"][0], mode


@on_every_device
def test_static_decode_after_snapkv_grows_the_room(device, monkeypatch):
    """SnapKV's cache keeps 64 slots of room; 80 tokens make the static buffer grow once (before the capture on CUDA)."""
    from kvrag.methods.snapkv import SnapKV

    rag = make_rag(device, "qwen2", torch.float32)
    runs = {mode: decode_mode(rag, "reuse", mode, monkeypatch, evict=SnapKV(budget=8), max_new_tokens=80) for mode in modes_on(device)}
    growing = runs["growing"][0]
    assert len(growing[0]) > 64
    for mode, (got, made) in runs.items():
        check_made(mode, got, made)
        assert got == growing, mode


def spy_decoders(monkeypatch):
    """The StaticDecoders kvrag.decode.stream makes, made as it asks (a list that fills as answers decode)."""
    import kvrag.decode.stream as decode_mod
    from kvrag.decode.static import StaticDecoder

    made = []
    monkeypatch.setattr(decode_mod, "StaticDecoder", lambda *a, **k: made.append(StaticDecoder(*a, **k)) or made[-1])
    return made


@on_every_device
def test_answers_decode_statically_by_default_and_match_the_eager_answer(device, monkeypatch):
    """DecodeConfig.static=None: on for CUDA (a graph), and on the CPU where the lean step applies (no graph)."""
    made = spy_decoders(monkeypatch)
    rag = make_rag(device, "llama", torch.float32)
    kw = dict(method="cacheblend", max_new_tokens=20, stop_at="none", temperature=0.7, seed=1)
    auto = rag.answer(Q, IDS, **kw)
    assert len(made) == 1 and made[0].graph == (device == "cuda") and made[0].forwards > 0
    assert (made[0].replays > 0) == (device == "cuda")
    eager = rag.answer(Q, IDS, static=False, **kw)
    assert len(made) == 1 and (auto.text, auto.stats.generated_tokens) == (eager.text, eager.stats.generated_tokens)


@on_every_device
def test_concurrent_answers_decode_together(device, monkeypatch):
    """Alone, an answer replays its graph (CUDA) or steps alone (CPU); beside others, the steps are
    batched (one forward for all; on CUDA a graph per batch size), and float32 greedy answers stay what they are alone."""
    import threading

    made = spy_decoders(monkeypatch)
    rag = make_rag(device, "llama", torch.float32)
    jobs = [("full", 24), ("cacheblend", 18), ("samkv", 30)]
    ask = lambda method, n: rag.answer(Q, IDS, method=method, max_new_tokens=n, stop_at="none").text
    alone = [ask(*job) for job in jobs]
    assert len(made) == len(jobs) and all(d.forwards > 0 and d.graph == (device == "cuda") for d in made)
    assert all(d.replays == (d.forwards if device == "cuda" else 0) for d in made)
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
    from kvrag.decode.batch import decode_batch_stats

    if device == "cuda":  # steps shared through the batcher, and every one, batched or alone, replays a graph
        stats = decode_batch_stats(rag.lm.model)
        assert stats.largest >= 2 and stats.replays == stats.steps > 0 and all(d.replays == d.forwards for d in made)


# -- layer-wise loading (kvrag.fuse.layer_feed): on CUDA copies on a side stream, overlapped with the passes;
# on the CPU (where it is off unless asked for) the same feed fills each layer in line --------------
LAYERWISE = [("reuse", {}), ("epic", {}), ("a3", {}), ("fusionrag", {}), ("cacheblend", {}), ("samkv", {}), ("kvlink", {"link_tokens": 2})]
STORES = {"host": "host://?pin=1", "disk": "disk://{tmp}?pin=1", "memory": "memory://"}  # pinned host, pinned reads (CUDA), on the device


def layerwise_rag(device, dtype, url, tmp_path):
    rag = KVRag(device_lm(device, "llama", dtype), store=url.format(tmp=tmp_path), check=False)
    rag.precompute(CHUNKS, progress=False)
    return rag


def layerwise_on(device):
    """The `repo.layerwise` that loads layer by layer: the default (None) on CUDA, asked for (True) on the CPU."""
    return None if device == "cuda" else True


@on_devices("dtype, store", [(d, s) for d in DTYPES for s in STORES], cpu=[(torch.float32, "disk")])
def test_layerwise_loading_gives_the_eager_logits(tmp_path, device, dtype, store):
    rag = layerwise_rag(device, dtype, STORES[store], tmp_path)
    assert rag.repo.layerwise is None and rag.repo.layerwise_load == (device == "cuda")  # the default: CUDA only
    on = layerwise_on(device)
    for method, params in LAYERWISE:
        rag.repo.layerwise = False
        eager = rag.prefill(Q, IDS, method=method, recompute_ratio=0.15, **params)
        rag.repo.layerwise = on
        lw = rag.prefill(Q, IDS, method=method, recompute_ratio=0.15, **params)
        assert lw.stats.layerwise and not eager.stats.layerwise and lw.stitched.feed is None
        assert rel(lw.logits, eager.logits) <= TOL[dtype]["logits"], method
        if dtype == torch.float32:
            assert torch.equal(lw.selected.cpu(), eager.selected.cpu()), method
            assert rel(lw.stitched.keys, eager.stitched.keys) <= TOL[dtype]["keys"], method
            kw = dict(method=method, recompute_ratio=0.15, max_new_tokens=6, stop_at="none", **params)
            rag.repo.layerwise = False
            want = rag.answer(Q, IDS, **kw).text
            rag.repo.layerwise = on
            assert rag.answer(Q, IDS, **kw).text == want, method
    rag.repo.layerwise = None


@pytest.mark.parametrize("store", ["host", "disk"])
@on_every_device
def test_layerwise_copies_are_non_blocking_from_pinned_memory(tmp_path, device, monkeypatch, store):
    """Every host-to-device copy of a chunk's KV is non-blocking and (CUDA) reads pinned memory. On the
    CPU the chunks are host memory already, and so is the prefix: the feed's non-blocking copies are counted."""
    from kvrag.fuse.layer_feed import LayerFeed

    rag = layerwise_rag(device, torch.bfloat16, STORES[store], tmp_path)
    rag.repo.layerwise = layerwise_on(device)
    rag.prefill(Q, IDS, method="cacheblend")  # warm: the prefix exists, the entries are stored
    copies, feeds = [], []
    real_copy, real_init = torch.Tensor.copy_, LayerFeed.__init__

    def spy(self, src, non_blocking=False):
        if self.device.type == device and src.device.type == "cpu" and (device == "cuda" or non_blocking):
            copies.append((non_blocking, src.is_pinned()))
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    monkeypatch.setattr(LayerFeed, "__init__", lambda self, *a, **k: (feeds.append(self), real_init(self, *a, **k))[1])
    pre = rag.prefill(Q, IDS, method="cacheblend")
    monkeypatch.undo()
    layers = rag.lm.config.num_hidden_layers
    feed = feeds[0]
    groups = -(-layers // feed.group)  # a chunk's layers of one copy group arrive in one copy
    host_sources = len(IDS) + (device == "cpu")  # every chunk (and on the CPU the prefix): keys and values, group by group
    assert len(copies) == 2 * groups * host_sources and feed.copies == 2 * groups * len(IDS)
    assert all(non_blocking and pinned == (device == "cuda") for non_blocking, pinned in copies), copies
    assert feed.cuda == (device == "cuda") and feed.order == list(range(layers)) and feed.complete
    # the copy work, and the part of it the passes waited for (never more than the work itself)
    assert pre.stats.layer_load_s > 0 and 0 <= pre.stats.load_wait_s <= pre.stats.layer_load_s + 1e-3


@on_every_device
def test_layerwise_layers_are_ensured_before_their_attention(tmp_path, device, monkeypatch):
    from kvrag.fuse.layer_feed import LayerFeed
    from kvrag.model.loading import decoder_of

    rag = layerwise_rag(device, torch.float32, STORES["host"], tmp_path)
    rag.repo.layerwise = layerwise_on(device)
    events = []
    ensure = LayerFeed.ensure
    monkeypatch.setattr(LayerFeed, "ensure", lambda self, i: (events.append(("ensure", i)), ensure(self, i))[1])
    hooks = [l.self_attn.register_forward_hook(lambda m, a, o, i=i: events.append(("attn", i))) for i, l in enumerate(decoder_of(rag.lm.model).layers)]
    try:
        assert rag.prefill(Q, IDS, method="reuse").stats.layerwise
    finally:
        for h in hooks:
            h.remove()
    layers = rag.lm.config.num_hidden_layers
    for i in range(layers):
        assert events.index(("ensure", i)) < events.index(("attn", i))
