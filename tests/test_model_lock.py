"""The lock belongs to the loaded model: engines sharing one model never run it at the same time."""

import threading
import time

from kvrag import Chunk, KVRag, from_model
from tiny import tiny_model, tiny_tokenizer

CHUNKS = [Chunk("a", "The cat sat on the mat."), Chunk("b", "Volcanoes erupt lava and ash."), Chunk("c", "Markets rose today.")]


def test_two_engines_over_one_model_never_overlap_forwards_or_probes():
    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    engines = [KVRag(lm, store="memory://"), KVRag(lm, store="memory://", system_prompt="Answer briefly.")]
    for e in engines:
        e.precompute(CHUNKS, progress=False)
    active, peak, guard = [0], [0], threading.Lock()

    forward = lm.model.forward

    def counted(*args, **kwargs):  # a probe ends its forward by raising: count in try/finally
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.002)  # widen the window in which a second forward could start
            return forward(*args, **kwargs)
        finally:
            with guard:
                active[0] -= 1

    lm.model.forward = counted
    errors: list[BaseException] = []

    def work(engine, method):
        try:
            for _ in range(3):
                engine.answer("What did the cat do?", ["a", "b", "c"], method=method, max_new_tokens=4)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(engines[0], "a3")), threading.Thread(target=work, args=(engines[1], "cacheblend"))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        del lm.model.forward
    assert not errors, errors
    assert peak[0] == 1, f"{peak[0]} forwards ran at once on one model"
    assert engines[0].lm.lock is engines[1].lm.lock


def _lock_free_elsewhere(lock) -> bool:
    """Whether another thread could take `lock` now (so the caller does not hold it)."""
    got = []

    def probe():
        ok = lock.acquire(blocking=False)
        got.append(ok)
        if ok:
            lock.release()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got[0]


def test_store_reads_happen_outside_the_model_lock_and_count_in_ttft(monkeypatch):
    """A slow store (disk, Redis) must not hold up other requests' forwards and decoding steps: the
    request's chunk entries are read before the lock is taken. The read still counts in its load
    time and TTFT: the store advances a fake clock by an hour, which both must include."""
    import kvrag.pipeline
    import kvrag.kv.repository

    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    rag = KVRag(lm, store="memory://")
    rag.precompute(CHUNKS, progress=False)
    store = rag.store
    real = store.get_many
    seen: list[bool] = []
    skew = [0.0]
    for mod in (kvrag.kv.repository, kvrag.pipeline):
        monkeypatch.setattr(mod, "clock", lambda device: skew[0])  # a fake clock: only the fake read moves it

    def slow(keys):
        seen.append(_lock_free_elsewhere(lm.lock))
        skew[0] += 3600.0  # the read "took" an hour
        return real(keys)

    store.get_many = slow
    try:
        for method in ("reuse", "cacheblend", "a3"):
            seen.clear()
            ticks = skew[0]
            ans = rag.answer("What did the cat do?", ["a", "b", "c"], method=method, max_new_tokens=2)
            assert seen and all(seen), f"{method}: a store read ran under the model lock"
            assert ans.stats.cache_hits == 3 and ans.stats.tiers == {"memory": 3}
            read = skew[0] - ticks  # what the fake clock moved during this answer: the store read alone
            assert read > 0 and ans.stats.load_s == read and ans.stats.ttft_s == read  # counted in both, no wall clock
        seen.clear()
        full = rag.answer("What did the cat do?", ["a", "b", "c"], method="full", max_new_tokens=2)
        assert full.stats.cache_hits == 0  # Full Attention reads no chunk KV
    finally:
        del store.get_many
