"""Issue #20 on the CPU: no host sync inside per-layer loops, and stage times that wait for the device."""

import contextlib

import pytest
import torch

from kvrag import Chunk, KVRag, from_model
from kvrag.methods.snapkv import SnapKV
from kvrag import timing
from tiny import tiny_model, tiny_tokenizer

CHUNKS = [
    Chunk("a", "The cat sat on the mat and purred all afternoon long, then slept by the fire."),
    Chunk("b", "Volcanoes erupt lava, ash and gas from deep below the crust of the planet."),
    Chunk("c", "Stock markets rose today after the central bank spoke about interest rates."),
]
Q = "What did the cat do?"
SYNCING = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "numpy")


@contextlib.contextmanager
def count_syncs():
    """Count the tensor calls that make the host wait for the device (on a GPU each is a sync)."""
    counts = {"n": 0}
    saved = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(fn):
        def counted(self, *args, **kwargs):
            counts["n"] += 1
            return fn(self, *args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _syncs(layers: int, **kwargs) -> int:
    rag = KVRag(from_model(tiny_model("llama", layers=layers), tiny_tokenizer()), store="memory://", check=False)
    rag.precompute(CHUNKS, progress=False)
    rag.prefill(Q, ["a", "b", "c"], **kwargs)  # warm: the prefix and caches exist
    with count_syncs() as counts:
        rag.prefill(Q, ["a", "b", "c"], **kwargs)
    return counts["n"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"method": "reuse"},
        {"method": "full"},
        {"method": "epic"},
        {"method": "a3"},
        {"method": "fusionrag"},
        {"method": "cacheblend"},
        {"method": "samkv"},
        {"method": "samkv", "update": "fusion"},
        {"method": "a3", "evict": SnapKV(budget=8)},
    ],
    ids=lambda kw: "-".join(str(v) if not isinstance(v, SnapKV) else "snapkv" for v in kw.values()),
)
def test_host_syncs_do_not_grow_with_the_layer_count(kwargs):
    """Twice the layers, the same number of host syncs: none sits inside a per-layer loop."""
    assert _syncs(4, **kwargs) == _syncs(8, **kwargs)


def test_snapkv_eviction_syncs_do_not_grow_with_the_layer_count():
    def run(layers):
        rag = KVRag(from_model(tiny_model("llama", layers=layers), tiny_tokenizer()), store="memory://", check=False)
        rag.precompute(CHUNKS, progress=False)
        pre = rag.prefill(Q, ["a", "b", "c"], method="reuse", evict=SnapKV(budget=8))
        with count_syncs() as counts:
            rag.pipeline._evict(pre, SnapKV(budget=8))
        return counts["n"]

    assert run(4) == run(8)


def test_stage_clock_waits_for_the_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    timing.clock("cuda")
    timing.clock("cpu")
    assert len(calls) == 1
