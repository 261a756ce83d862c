"""What a reuse prefill issues, counted on the CPU as a GPU would pay for it (torch.profiler).

On a GPU the question's pass over stored KV is host-bound when the host issues work per chunk and
per layer: each kernel-launching op is a launch, each host sync drains the queue. Here the same
code runs on the CPU (layer-wise loading with the copy groups CUDA uses), and the counts must not
grow the wrong way: host syncs with neither chunks nor layers, the ops each chunk adds with no
layer count, the ops each layer adds with no chunk count.
"""

import pytest
import torch

from kvrag import Chunk, KVRag, from_model
from kvrag.eval.prefill_profile import SYNC_OPS, count_ops, profile_prefill
from kvrag.fuse import layer_feed
from tiny import tiny_model, tiny_tokenizer

Q = "What did the cat do?"
WORDS = "cat mat sun sea red owl fig jam bay oak elk ivy".split()


def chunks(n: int) -> list[Chunk]:
    return [Chunk(f"c{i}", " ".join(WORDS[(i + j) % len(WORDS)] for j in range(9 + i % 4)) + ".") for i in range(n)]


def counts(layers: int, n_chunks: int, layerwise: bool, store: str = "memory://", method: str = "reuse"):
    rag = KVRag(from_model(tiny_model("llama", layers=layers), tiny_tokenizer()), store=store, check=False)
    cs = chunks(n_chunks)
    rag.precompute(cs, progress=False)
    rag.repo.layerwise = layerwise
    return profile_prefill(rag, Q, [c.id for c in cs], method=method)


@pytest.fixture
def cuda_groups(monkeypatch):
    """The layer feed's copy groups as on CUDA: two groups of layers, whatever the chunk count."""
    monkeypatch.setattr(layer_feed, "group_size", lambda layers, chunks, cuda, budget=0: -(-layers // 2), raising=False)


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "eager"])
def test_reuse_prefill_ops_grow_per_chunk_and_per_layer_never_per_both(cuda_groups, layerwise):
    c = {(L, n): counts(L, n, layerwise) for L in (4, 8) for n in (3, 9)}
    syncs = {k: v.sync_count for k, v in c.items()}
    assert len(set(syncs.values())) == 1, syncs  # no host sync per chunk or per layer
    per_chunks = {L: c[(L, 9)].kernel_ops - c[(L, 3)].kernel_ops for L in (4, 8)}
    per_layers = {n: c[(8, n)].kernel_ops - c[(4, n)].kernel_ops for n in (3, 9)}
    assert per_chunks[4] == per_chunks[8], per_chunks  # six more chunks cost the same ops at 4 and 8 layers
    assert per_layers[3] == per_layers[9], per_layers  # four more layers cost the same ops at 3 and 9 chunks
    assert per_chunks[4] <= 6 * 2 * 2, per_chunks  # keys and values, one copy per chunk per copy group


def test_a_fresh_entry_from_disk_is_not_scanned_again(tmp_path):
    """An entry its writer found finite is read without a whole-context scan (nor its per-chunk sync)."""
    disk = counts(4, 3, False, store=f"disk://{tmp_path}")
    more = counts(4, 9, False, store=f"disk://{tmp_path / 'b'}")
    assert disk.sync_count == more.sync_count, (disk.syncs, more.syncs)


def test_the_counter_sees_a_host_sync():
    """The count can fail: an .item() and a nonzero in the profiled region are counted."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = torch.arange(10.0)
        t.sum().item()
        torch.nonzero(t > 3)
        (t * 2).add_(1)
    c = count_ops(prof)
    assert c.syncs.get("aten::_local_scalar_dense") == 1 and c.syncs.get("aten::nonzero") == 1
    assert c.by_op["aten::mul"] == 1 and c.by_op["aten::add_"] == 1
    assert set(c.syncs) <= set(SYNC_OPS)
