"""Attention at one query row per sequence: what a decode step attends with (kvrag.decode.lean).

Why its own function and not SDPA: at one query row the work is reading the keys and values once.
- Grouped queries: the query heads that share a K/V head are stacked as rows of one matrix
  ([rows, kv_heads, group, d]), so K/V are read as they are stored, never repeated per query head
  (SDPA repeats them whenever it is given a mask).
- One additive bias a step ([rows, 1, 1, keys], built once for every layer) hides what a row must not
  see: the room after its own slots in a fixed-shape buffer. A caller with nothing to hide passes None.
- Split along the keys (flash-decoding): scores and softmax run over all keys at once (one matrix
  product spreads the keys over the whole GPU); the product with V, whose reduction runs along the
  keys and whose output is only [group, d] a head, is cut into `splits` blocks of keys computed side
  by side and summed in float32. Without the split cuBLAS gives that product one block a head: on an
  H200 at 8k tokens, a `cutlass_80_wmma` kernel took 77 us a layer where reading the layer's K/V
  takes ~3 us (MEASURED.md, 2026-11-27). The softmax is exact (global), so no rescaling is needed.
"""

from __future__ import annotations

import torch

from kvrag.defaults import Ape
from kvrag.model.ape import ape_logits

MIN_KEYS_PER_SPLIT = 128  # a split's block of keys: below this the blocks' own overhead dominates


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scaling: float,
                splits: int = 1, ape: "tuple[torch.Tensor, Ape] | None" = None) -> torch.Tensor:
    """Each row's one query (q [rows, heads, 1, d]) over its own keys (k, v [rows, kv_heads, S, d]) with an
    additive `bias` [rows, 1, 1, S] (or None), as transformers' eager attention computes it: scores in
    the model's dtype, softmax in float32, probabilities cast back. `splits` (dividing S): blocks of
    keys for the product with V (see the module docstring); 1 = one product. `ape`: (bool [rows, 1, 1, S]
    marking the chunk slots, the Ape) to attend as APE does (kvrag.model.ape; scores in float32 then).
    Returns [rows, 1, heads, d]."""
    rows, heads, _, d = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    group = heads // kv_heads
    grouped = q.reshape(rows, kv_heads, group, d)  # query head h reads kv head h // group, as repeat_kv pairs them
    scores = torch.matmul(grouped, k.transpose(-1, -2)) * scaling
    if ape is not None:
        scores = ape_logits(scores, ape[0], ape[1])
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    if splits <= 1:
        out = torch.matmul(probs, v)
    else:
        c = S // splits
        blocks = probs.reshape(rows, kv_heads, group, splits, c).transpose(2, 3)  # [rows, kv, splits, group, c]
        partial = torch.matmul(blocks, v.reshape(rows, kv_heads, splits, c, d))  # [rows, kv, splits, group, d]
        out = partial.sum(dim=2, dtype=torch.float32).to(v.dtype)
    return out.reshape(rows, 1, heads, d)


def key_splits(rows: int, kv_heads: int, keys: int, device: torch.device) -> int:
    """How many blocks of keys the product with V is cut into (attend_rows): 1 on the CPU (its cores
    are busy with one product already); on CUDA, enough blocks that the product has at least two
    matrices for each multiprocessor, each block at least MIN_KEYS_PER_SPLIT keys, a power of two
    dividing `keys`."""
    if device.type != "cuda":
        return 1
    want = 2 * _multiprocessors(device)
    s = 1
    while rows * kv_heads * s < want and keys % (2 * s) == 0 and keys // (2 * s) >= MIN_KEYS_PER_SPLIT:
        s *= 2
    return s


_SMS: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
