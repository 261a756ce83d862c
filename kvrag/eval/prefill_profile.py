"""Where a reuse prefill's host time goes: torch.profiler over one prefill, counted as a GPU pays.

A GPU prefill over stored KV is host-bound when the host issues more ops than the device needs:
each kernel-launching op costs a launch, each host sync (`aten::_local_scalar_dense` behind
`.item()`/`bool()`, `aten::nonzero`, `aten::equal` on device tensors) drains the queue. This
counts both in one prefill, on any device, so the CPU suite can watch what a GPU would pay
(`tests/test_prefill_profile.py`) and the GPU chain can write the same table with CUDA times
(`scripts/gpu/prefill_profile.py`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

# ops that make the host wait for the device (on the CPU they cost nothing, which is why we count them)
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::item")
# ops that move no data and launch no kernel: views, metadata, allocation, dispatch wrappers
NO_KERNEL = frozenset(
    "aten::" + n
    for n in (
        "view as_strided reshape _reshape_alias _unsafe_view slice select unsqueeze squeeze expand expand_as t "
        "transpose permute movedim view_as unflatten flatten narrow unbind split split_with_sizes chunk alias "
        "detach detach_ lift_fresh resolve_conj resolve_neg empty empty_strided empty_like new_empty "
        "new_empty_strided result_type dim size stride is_same_size is_nonzero item _local_scalar_dense to "
        "_to_copy contiguous clone broadcast_tensors numpy_T resize_ as_strided_ scalar_tensor set_ "
        "_has_compatible_shallow_copy_type record_stream"
    ).split()
)


@dataclass
class OpProfile:
    """Counts of one profiled region: leaf ops that launch a kernel, host syncs, copies."""

    kernel_ops: int
    syncs: dict[str, int]
    copies: int
    by_op: Counter = field(default_factory=Counter)
    table: str = ""

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())

    def as_dict(self) -> dict[str, Any]:
        return {"kernel_ops": self.kernel_ops, "syncs": dict(self.syncs), "sync_count": self.sync_count,
                "copies": self.copies, "top_ops": self.by_op.most_common(20)}


def count_ops(prof: Any) -> OpProfile:
    """Aten ops that launch a kernel: an op counts unless a direct child outside NO_KERNEL does its work
    (so `x * 2` counts its mul, whose only child wraps the scalar, and a `linear` counts its `mm`)."""
    leaf: Counter = Counter()
    every: Counter = Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        every[e.name] += 1
        if e.name in NO_KERNEL or any(c.name.startswith("aten::") and c.name not in NO_KERNEL for c in e.cpu_children):
            continue
        leaf[e.name] += 1
    syncs = {name: every[name] for name in SYNC_OPS if every[name]}
    return OpProfile(sum(leaf.values()), syncs, every["aten::copy_"], leaf)


def profiled(fn: Callable[[], Any], cuda: bool = False, rows: int = 25) -> tuple[Any, OpProfile]:
    """Run fn() under torch.profiler (CPU, and CUDA when asked) and count its ops."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
    counts = count_ops(prof)
    avg = prof.key_averages()
    counts.table = avg.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=50)
    if cuda:
        counts.table += "\n" + avg.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=50)
    return out, counts


def profile_prefill(rag: Any, question: str, chunk_ids: list[str], warm: int = 1, **kwargs: Any) -> OpProfile:
    """One prefill of `question` over stored chunks, after `warm` unprofiled ones (prefix, buffers)."""
    cuda = rag.lm.device.type == "cuda"
    for _ in range(warm):
        rag.prefill(question, chunk_ids, **kwargs)
    _, counts = profiled(lambda: rag.prefill(question, chunk_ids, **kwargs), cuda=cuda)
    return counts
