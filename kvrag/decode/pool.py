"""Fixed slots for the sequences that decode together: the buffers a batched decode step (and its CUDA graphs) reads.

Why: a CUDA graph replays fixed shapes at fixed addresses, so sequences that come and go cannot
each bring their own buffers to a captured step. Here every sequence that decodes gets a row (a
`Seat`) of one pool per model: per layer a K and a V buffer [rows, kv_heads, capacity, d]. Its
context's K/V are copied into its row when it starts (one device copy), its answer's K/V are copied
back to its own cache when it ends (so the cache reads as decoded, for the exact prefix cache), and
every step in between writes and reads the row in place. The step's other inputs live in one
persistent tensor `inputs` [rows, 3] (token, position, the slot written); a step copies its values
into it, never replacing it.

The live rows are always rows 0..n-1 (a sequence that leaves hands its row to the last one, whose
K/V are moved once), so a step of n sequences runs the smallest row bucket >= n (ROW_BUCKETS, as vLLM
captures its graphs) and attends over the smallest span (`span_bucket`) that holds its longest
sequence: shapes come from a small set, each captured once. Rows of the bucket that do not step this
time (padding, or a sequence that has not handed its next token yet) feed token 0 at position 0 and
write the scratch slot (the last of the capacity, which no sequence owns), so they change nothing;
their outputs are ignored.

Growing (more rows, or a longer sequence than the capacity holds) reallocates the buffers and bumps
`generation`: graphs captured over the old buffers are dropped (kvrag.decode.graphs). The pool never
shrinks while sequences hold rows; `clear` frees it once none do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

KV = tuple[torch.Tensor, torch.Tensor]
ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
# Every span (and the capacity) is a multiple of this: key splits divide it (kvrag.decode.attend), and
# every row of a step's scores starts 512-byte aligned whatever the context's length (the single-sequence
# step attended over its room's own length, odd at 16k on the H200: 16,725 slots, rows 2-byte aligned).
SPAN_UNIT = 256


def row_bucket(n: int) -> int:
    """The smallest row bucket holding n sequences."""
    for b in ROW_BUCKETS:
        if b >= n:
            return b
    raise ValueError(f"at most {ROW_BUCKETS[-1]} sequences decode together, asked for {n}")


def span_bucket(n: int) -> int:
    """The keys a step attends over when its longest sequence holds n slots: a multiple of 256 up to
    1024, then four sizes an octave (1280, 1536, 1792, 2048, 2560, ...): at most 25% over n, and a
    sequence growing by an answer's length crosses at most one or two."""
    n = max(n, 1)
    unit = max(SPAN_UNIT, 1 << max(0, (n - 1).bit_length() - 3))
    return -(-n // unit) * unit


@dataclass(eq=False)
class Seat:
    """A sequence's row of the pool: its context fills slots [0, start), its answer is written from
    `start` on, at most up to `limit` (exclusive); `end`: the slots holding its K/V so far."""

    row: int
    start: int
    limit: int
    end: int


class SlotPool:
    """Per-layer K/V buffers with one row per decoding sequence, and the step's persistent inputs."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_rows: int = ROW_BUCKETS[-1], min_rows: int = 1) -> None:
        """`min_rows`: rows made at once (a server's concurrency), so the first sequences that decode
        together do not reallocate the pool (and drop its graphs) as each one joins."""
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_rows = min(max_rows, ROW_BUCKETS[-1])
        self.min_rows = row_bucket(max(1, min(min_rows, self.max_rows)))
        self.rows = self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.inputs = torch.zeros((0, 3), dtype=torch.long, device=self.device)
        self.slots = torch.zeros(0, dtype=torch.long, device=self.device)  # 0..capacity-1: what a span's mask compares
        self.seats: list[Seat] = []  # seats[r].row == r
        self.generation = 0  # bumped whenever the buffers are reallocated

    @property
    def scratch(self) -> int:
        """The slot rows that do not step write: the last, never a sequence's."""
        return self.capacity - 1

    def fits(self, kv: Sequence[KV], limit: int) -> bool:
        """Whether a sequence with this context (per-layer [1, kv_heads, >= start, d]) can take a row."""
        k = kv[0][0]
        return (len(kv) == self.layers and len(self.seats) < self.max_rows and k.shape[0] == 1 and k.shape[1] == self.kv_heads
                and k.shape[-1] == self.head_dim and k.dtype == self.dtype and k.device == self.device and limit >= 1)

    def seat(self, kv: Sequence[KV], start: int, limit: int) -> Seat:
        """A row for a sequence whose first `start` slots of `kv` are its context and that may write up to
        `limit`: the context is copied in (the pool grows first if it must)."""
        rows, capacity = len(self.seats) + 1, span_bucket(limit + 1)  # + the scratch slot
        if rows > self.rows or capacity > self.capacity:
            self._grow(max(self.rows, row_bucket(rows), self.min_rows), max(self.capacity, capacity))
        seat = Seat(len(self.seats), start, limit, start)
        for (kbuf, vbuf), (k, v) in zip(zip(self.k, self.v), kv):
            kbuf[seat.row, :, :start].copy_(k[0, :, :start])
            vbuf[seat.row, :, :start].copy_(v[0, :, :start])
        self.seats.append(seat)
        return seat

    def release(self, seat: Seat, into: Sequence[KV] | None = None) -> None:
        """The sequence is done: its answer's slots [start, end) are copied into `into` (per-layer
        [1, kv_heads, >= end, d], its own cache's buffers), and the last row moves into its row."""
        if seat not in self.seats:
            return
        r = seat.row
        if into is not None and seat.end > seat.start:
            for (kbuf, vbuf), (k, v) in zip(zip(self.k, self.v), into):
                k[0, :, seat.start : seat.end].copy_(kbuf[r, :, seat.start : seat.end])
                v[0, :, seat.start : seat.end].copy_(vbuf[r, :, seat.start : seat.end])
        last = self.seats.pop()
        if last is not seat:
            for kbuf, vbuf in zip(self.k, self.v):
                kbuf[r, :, : last.end].copy_(kbuf[last.row, :, : last.end])
                vbuf[r, :, : last.end].copy_(vbuf[last.row, :, : last.end])
            last.row = r
            self.seats[r] = last

    def row_buffers(self, row: int) -> list[KV]:
        """One row's per-layer buffers as [1, kv_heads, capacity, d] views (the multi-row eager step's input)."""
        return [(k[row : row + 1], v[row : row + 1]) for k, v in zip(self.k, self.v)]

    def set_inputs(self, feeds: Sequence[tuple[Seat, int, int, int]]) -> tuple[int, int]:
        """Copy this step's (seat, token, position, slot) into the persistent inputs; every other row of
        the bucket writes the scratch slot. Returns (rows, span) of the step to run."""
        rows = row_bucket(max(s.row for s, _, _, _ in feeds) + 1)
        values = [[0, 0, self.scratch] for _ in range(rows)]
        longest = 1
        for seat, token, position, slot in feeds:
            if not seat.start <= slot < seat.limit:
                raise RuntimeError(f"slot {slot} is outside this sequence's room [{seat.start}, {seat.limit})")
            values[seat.row] = [token, position, slot]
            seat.end = max(seat.end, slot + 1)
            longest = max(longest, slot + 1)
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":  # pinned: the copy is queued, the host never waits for the device
            self.inputs[:rows].copy_(host.pin_memory(), non_blocking=True)
        else:
            self.inputs[:rows].copy_(host)
        return rows, min(span_bucket(longest), self.capacity)

    def step_inputs(self, rows: int, span: int) -> tuple[torch.Tensor, torch.Tensor, list[KV], torch.Tensor, torch.Tensor]:
        """What the step of `rows` rows over `span` keys reads (views of the persistent tensors: the same
        addresses every step): tokens [rows, 1], positions [rows, 1], the per-layer buffers' first `rows`
        rows, the slots written [rows], and the slot indices 0..span-1."""
        x = self.inputs[:rows]
        return x[:, 0:1], x[:, 1:2], [(k[:rows], v[:rows]) for k, v in zip(self.k, self.v)], x[:, 2], self.slots[:span]

    def clear(self) -> bool:
        """Free the buffers if no sequence holds a row (True if freed)."""
        if self.seats:
            return False
        self.k, self.v, self.rows, self.capacity = [], [], 0, 0
        self.inputs = self.inputs[:0].clone()
        self.slots = self.slots[:0].clone()
        self.generation += 1
        return True

    def _grow(self, rows: int, capacity: int) -> None:
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        live, held = len(self.seats), self.capacity
        k, v = [], []
        for old_k, old_v in zip(self.k or [None] * self.layers, self.v or [None] * self.layers):
            nk = torch.zeros(shape, dtype=self.dtype, device=self.device)  # finite everywhere: masked slots weigh 0
            nv = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old_k is not None and live:
                nk[:live, :, :held].copy_(old_k[:live])
                nv[:live, :, :held].copy_(old_v[:live])
            k.append(nk)
            v.append(nv)
        self.k, self.v = k, v
        inputs = torch.zeros((rows, 3), dtype=torch.long, device=self.device)
        inputs[:, 2] = capacity - 1
        self.inputs = inputs
        self.slots = torch.arange(capacity, device=self.device)
        self.rows, self.capacity = rows, capacity
        self.generation += 1
