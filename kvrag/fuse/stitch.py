"""Stitching stored KV and the one recompute pass that every method shares.

Recompute pass: the selected chunk tokens plus the question run in a single forward at their
true positions over the stitched cache, with a causal mask by position; each layer overwrites (or
blends into) the selected slots before attending, so later layers see the corrected KV. With every
chunk token selected this is exactly Full Attention; with none it is Full Reuse (question prefill).

The stitched context may be sparse (SamKV keeps a subset of slots): each slot carries its global
position, the mask compares positions, and keys keep the rotation of their true position.

KVLink link slots (`segments.links > 0`): K empty slots after every chunk. They are part of every
recompute pass (a selection rule's budget counts chunk tokens only): their inputs are the link
embeddings, their mask is KVLink's picture (`kvrag.fuse.links.link_picture`), and the pass overwrites
them layer by layer like any recomputed token. In a pass that does not compute them (a selection
probe) they are hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from kvrag.model.cache import SpliceCache, cache_arg, prefix_cache
from kvrag.fuse.layer_feed import DEFAULT_LOOKAHEAD, LayerFeed
from kvrag.kv.layout import Segments
from kvrag.model.attention import PassSpec, Rule, attending_by, uses_spec
from kvrag.fuse.links import embed_with_links, link_picture
from kvrag.model.masks import additive, causal_allowed
from kvrag.model.loading import LoadedModel
from kvrag.model.cache import LayerStack, unstack_layers
from kvrag.model.rope import Rotary
from kvrag.defaults import Ape
from kvrag.errors import UnsupportedModelError

# A key slot no query may see in this pass (a link slot the pass does not compute).
HIDDEN_POSITION = torch.iinfo(torch.long).max


@dataclass
class Stitched:
    """The reused context: per-layer stacked KV over prefix + chunks, keys at global positions."""

    keys: torch.Tensor  # [layers, kv_heads, slots, head_dim]
    values: torch.Tensor
    segments: Segments
    positions: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [slots] global position of each slot
    room: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # buffers with free slots after `keys`
    # layer-wise loading: the layers of `keys`/`values` not filled yet come from this feed on demand
    # (`ensure`); None once every layer is filled (or when stitched eagerly)
    feed: LayerFeed | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.positions is None:
            self.positions = torch.arange(self.keys.shape[2])

    def ensure(self, layers: Iterable[int]) -> None:
        """Make these layers' KV usable by work queued from now on (a no-op when stitched eagerly)."""
        if self.feed is not None:
            self.feed.ensure_layers(layers)

    def ensure_all(self) -> None:
        """Every layer usable: what anything reading `keys`/`values` across layers needs first."""
        if self.feed is not None:
            self.feed.ensure_all()

    def splice_cache(self) -> SpliceCache:
        """A cache over this context's tensors (written in place by a pass), using the reserved room;
        with a layer feed, each layer is ensured right before the pass first updates it."""
        ready = self.feed.ensure if self.feed is not None else None
        if self.room is None:
            return SpliceCache(unstack_layers(self.keys, self.values), ready=ready)
        kb, vb = self.room
        n = self.keys.shape[2]
        return SpliceCache(unstack_layers(kb, vb), kb.shape[2] - n, [n] * kb.shape[0], ready=ready)

    @property
    def chunk_spans(self) -> list[tuple[int, int]]:
        """[start, end) global positions of each chunk."""
        return [(s, s + len(c)) for s, c in zip(self.segments.chunk_starts, self.segments.chunks)]

    def chunk_positions(self) -> torch.Tensor:
        """Positions held here that belong to chunks (the only ones a method may select; never link slots)."""
        p = self.positions
        inside = (p >= len(self.segments.prefix)) & (p < self.segments.context_len)
        if self.segments.links:
            inside &= ~torch.isin(p, self.link_positions())
        return p[inside]

    def link_positions(self) -> torch.Tensor:
        """Positions of the KVLink link slots (empty without links)."""
        return torch.tensor(self.segments.link_positions(), dtype=torch.long)

    def slots_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Slot index of each given global position (which must be held here)."""
        pos = positions.to(self.positions.device)
        slots = torch.searchsorted(self.positions, pos)
        if slots.numel() and (slots.max() >= self.positions.numel() or not torch.equal(self.positions[slots], pos)):
            raise ValueError("selected positions are not held in the stitched context")
        return slots

    def keep(self, positions: torch.Tensor) -> "Stitched":
        """A sparser context with only these global positions (sorted; the prefix and link slots are always kept)."""
        self.ensure_all()  # the copy reads every layer
        prefix = torch.arange(len(self.segments.prefix))
        pos = torch.cat([prefix, self.link_positions(), positions.to(torch.long).cpu()]).unique(sorted=True)
        slots = self.slots_of(pos).to(self.keys.device)
        reserve = self.room[0].shape[2] - self.keys.shape[2] if self.room is not None else 0
        kbuf = self.keys.new_empty(*self.keys.shape[:2], slots.numel() + reserve, self.keys.shape[3])
        vbuf = self.values.new_empty(*self.values.shape[:2], slots.numel() + reserve, self.values.shape[3])
        n = slots.numel()
        kbuf[:, :, :n].copy_(self.keys[:, :, slots])
        vbuf[:, :, :n].copy_(self.values[:, :, slots])
        return Stitched(kbuf[:, :, :n], vbuf[:, :, :n], self.segments, pos, room=(kbuf, vbuf) if reserve else None)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


def stitch(
    prefix: LayerStack,
    chunks: Sequence[LayerStack],
    segments: Segments,
    rotary: Rotary,
    reserve: int = 0,
    layerwise: bool = False,
    lookahead: int = DEFAULT_LOOKAHEAD,
) -> Stitched:
    """Concatenate RoPE-free chunk KV after the prefix and rotate keys to their global positions.

    Each chunk's raw KV is copied once into one preallocated buffer (all layers and heads in one op),
    then every key after the prefix is rotated in place with cos/sin computed once: the op count
    grows with the chunks by two copies each, never by a rotation each. `reserve` slots
    are left free after the context for the question and the answer, which append in place.

    `layerwise=True` only allocates the buffers: a `LayerFeed` fills each layer when first ensured
    (chunks may then stay on the host, pinned on CUDA), so loading overlaps the passes.
    """
    pk, pv = prefix
    n_prefix, total = pk.shape[2], segments.context_len
    kbuf = pk.new_empty(*pk.shape[:2], total + reserve, pk.shape[3])
    vbuf = pv.new_empty(*pv.shape[:2], total + reserve, pv.shape[3])
    # with no room asked for, the buffers are the context itself (not views: training writes
    # tensors that carry gradients into them, which autograd allows on a leaf but not a view of one)
    keys, values = (kbuf[:, :, :total], vbuf[:, :, :total]) if reserve else (kbuf, vbuf)
    room = (kbuf, vbuf) if reserve > 0 else None
    if layerwise:
        return Stitched(keys, values, segments, room=room, feed=LayerFeed(prefix, chunks, segments, rotary, keys, values, lookahead))
    keys[:, :, :n_prefix] = pk
    values[:, :, :n_prefix] = pv
    if not chunks:
        return Stitched(keys, values, segments, room=room)
    for start, (k, v) in zip(segments.chunk_starts, chunks):  # raw KV: one copy per chunk for every layer
        end = start + k.shape[2]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
    # every chunk's keys rotated at once (cos/sin computed once), a few layers at a time
    span = keys[:, :, n_prefix:total]
    rotary.rotate_in_place(span, *rotary.cos_sin(torch.arange(n_prefix, total), span))
    if segments.links:  # link slots: empty until the recompute pass computes them
        link = torch.tensor(segments.link_positions(), device=keys.device)
        keys.index_fill_(2, link, 0)
        values.index_fill_(2, link, 0)
    return Stitched(keys, values, segments, room=room)


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # [vocab] logits at the last prompt position
    cache: object  # a transformers Cache ready for decoding
    next_position: int


def pass_inputs(stitched: Stitched, selected: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids, positions, and key positions for a pass over `selected` positions + the question.

    Link slots not among `selected` hold nothing yet: their key position is HIDDEN_POSITION, which
    the causal rule (here and in a probe's attention) never lets a query see.
    """
    seg = stitched.segments
    q_pos = torch.arange(seg.context_len, seg.total_len, device=device)
    positions = torch.cat([selected.to(device), q_pos])
    input_ids = torch.tensor(seg.all_ids(), device=device)[positions][None]
    slot_pos = stitched.positions.to(device)
    if seg.links:
        empty = torch.isin(slot_pos, stitched.link_positions().to(device)) & ~torch.isin(slot_pos, selected.to(device))
        slot_pos = torch.where(empty, torch.full_like(slot_pos, HIDDEN_POSITION), slot_pos)
    key_pos = torch.cat([slot_pos, q_pos])
    return input_ids, positions, key_pos


def forward_pass(
    lm: LoadedModel,
    cache: SpliceCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    key_pos: torch.Tensor,
    rule: Rule | None = None,
    inputs_embeds: torch.Tensor | None = None,
    name: str = "pass",
    ape: PassApe | None = None,
):
    """One forward of tokens at `positions` over `cache` whose slots sit at `key_pos`: causal by
    position, or by `rule` (positions -> boolean [q, kv]); `inputs_embeds` replaces the ids' embeddings.

    On `kvrag_sdpa` models the pass attends in query blocks by position (kvrag.model.attention: no mask
    over the whole pass); on eager models it hands the model the dense additive mask."""
    inputs = {"inputs_embeds": inputs_embeds} if inputs_embeds is not None else {"input_ids": input_ids}
    run = dict(position_ids=positions[None], use_cache=True, logits_to_keep=1, **cache_arg(lm.model, cache))
    if uses_spec(lm.model):
        spec = PassSpec(positions, key_pos, rule, name)
        if ape is not None:
            spec.ape, spec.ape_rows, spec.ape_context = ape.ape, ape.rows, ape.context
        with attending_by(spec) as marker:
            return lm.model(**inputs, attention_mask=marker, **run)
    if ape is not None:
        raise UnsupportedModelError(
            "APE needs kvrag's attention (a model loaded with attn_implementation='sdpa'), not "
            f"{getattr(lm.model.config, '_attn_implementation', None)!r}")
    allowed = causal_allowed(positions, key_pos) if rule is None else rule(positions, key_pos)
    return lm.model(**inputs, attention_mask=additive(allowed, lm.dtype)[None, None], **run)


def pass_rule(stitched: Stitched, selected: torch.Tensor) -> Rule | None:
    """The recompute pass's attention rule: causal by position (None), or KVLink's picture when there
    are link slots (selected chunk tokens are recomputed, so they are global rows of the picture)."""
    if not stitched.segments.links:
        return None
    segments = stitched.segments
    return lambda query_pos, key_pos: link_picture(segments, query_pos, key_pos, global_rows=selected)


@dataclass(frozen=True)
class PassApe:
    """APE in a recompute pass: its last `rows` queries (the question) over the key slots `context` marks."""

    ape: Ape
    rows: int
    context: torch.Tensor  # bool [kv slots of the pass]


def context_slots(stitched: Stitched) -> tuple[int, int]:
    """The stitched cache's chunk slots, [start, stop): after the prefix, before the question (APE's context)."""
    return len(stitched.segments.prefix), int(stitched.keys.shape[2])


def pass_ape(ape: Ape | None, stitched: Stitched, key_pos: torch.Tensor) -> PassApe | None:
    """The pass's APE over its chunk slots (link slots, computed at question time, are not context)."""
    if ape is None or not ape.active:
        return None
    seg = stitched.segments
    ctx = (key_pos >= len(seg.prefix)) & (key_pos < seg.context_len)
    if seg.links:
        ctx &= ~torch.isin(key_pos, stitched.link_positions().to(key_pos.device))
    return PassApe(ape, seg.total_len - seg.context_len, ctx)


@torch.no_grad()
def recompute(
    lm: LoadedModel,
    stitched: Stitched,
    selected: torch.Tensor,
    update: str = "overwrite",
    link_embeds: torch.Tensor | None = None,
    ape: Ape | None = None,
) -> PrefillOutput:
    """The shared recompute pass over `selected` chunk positions, the link slots, and the question.

    `update="fusion"` blends the recomputed KV into the reused KV (SamKV eq. 4) instead of
    overwriting it (link slots, which hold nothing to blend with, are always overwritten).
    `link_embeds` [link slots, hidden]: the inputs of the link slots, in position order.
    `ape`: the question's attention over the chunk slots as APE takes it (kvrag.model.ape; None or
    T = S = 1: ordinary attention).
    """
    device = lm.device
    selected = selected.to(device=device, dtype=torch.long).sort().values
    links = stitched.link_positions().to(device)
    rows = torch.cat([selected, links]).sort().values if links.numel() else selected
    input_ids, positions, key_pos = pass_inputs(stitched, rows, device)
    embeds = None
    if links.numel():
        if link_embeds is None:
            raise ValueError("the stitched context has link slots: pass their embeddings (link_embeds)")
        embeds = embed_with_links(lm.model, input_ids, torch.isin(positions, links)[None], link_embeds.to(device))
    cache = stitched.splice_cache()
    exact = torch.isin(rows, links) if links.numel() else None
    cache.overwrite(stitched.slots_of(rows).to(device) if rows.numel() else None, mode=update, exact=exact)
    out = forward_pass(lm, cache, input_ids, positions, key_pos, pass_rule(stitched, selected), embeds, name="recompute",
                       ape=pass_ape(ape, stitched, key_pos))
    cache.overwrite(None)
    return PrefillOutput(out.logits[0, -1].float(), cache, stitched.segments.total_len)


@torch.no_grad()
def full_prefill(lm: LoadedModel, prefix: LayerStack, segments: Segments, reserve: int = 0) -> PrefillOutput:
    """Full Attention: the prefix from cache (the system prefix, or a longer stretch an earlier turn
    computed: kvrag.kv.prefix_cache), every token after it prefilled (into room reserved for them
    and `reserve` more slots for the answer)."""
    device = lm.device
    s = prefix[0].shape[2]
    cache = prefix_cache(unstack_layers(*prefix), reserve=segments.total_len - s + reserve)
    ids = torch.tensor(segments.all_ids()[s:], device=device)[None]
    positions = torch.arange(s, segments.total_len, device=device)[None]
    # the model's own attention and masks (sliding windows included): Full Attention is the reference
    out = lm.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **cache_arg(lm.model, cache))
    return PrefillOutput(out.logits[0, -1].float(), cache, segments.total_len)
