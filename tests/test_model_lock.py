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
