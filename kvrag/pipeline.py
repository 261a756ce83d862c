"""The request pipeline: segments -> load -> stitch -> select -> recompute -> decode -> stats.

One `AnswerOptions` travels through it. The model's lock (`LoadedModel.lock`) is held for every
forward and probe, so engines that share one loaded model never run the model at the same time;
decoding takes it per token, so concurrent streams interleave and an abandoned stream holds nothing.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from kvrag.model.loading import LoadedModel
from kvrag.model.attention import kernel_log
from kvrag.chat import Conversation
from kvrag.model.cache import cache_kv, cache_len, cache_nbytes
from kvrag.decode.stream import DecodeConfig, DecodeState, stream_tokens
from kvrag.errors import ContextTooLongError
from kvrag.methods.snapkv import SnapKV
from kvrag.fuse.stitch import PrefillOutput, Stitched, context_slots, full_prefill, recompute, stitch
from kvrag.model.ape import DecodeApe, decoding_with
from kvrag.kv.layout import Segments
from kvrag.methods.auto_ratio import AutoRatio, auto_budget
from kvrag.methods import LinkSlots, Method, PrepareContext, ScoredMethod, SelectContext, Selection, token_budget
from kvrag.model.loading import decoder_of
from kvrag.kv.kinds import KIND_CHUNK
from kvrag.options import AnswerOptions
from kvrag.fuse.probe import ProbeResult, capture_queries
from kvrag.kv.prefix_cache import PrefixCache
from kvrag.kv.repository import KVRepository, Resolved, drop_non_finite
from kvrag.model.rope import Rotary
from kvrag.timing import clock
from kvrag.types import Answer, AnswerStats, Chunk

log = logging.getLogger("kvrag")


@dataclass
class Prefill:
    """A prefilled prompt, ready to decode; tests and the benchmark read its logits and selection."""

    output: PrefillOutput
    segments: Segments
    selected: torch.Tensor
    stats: AnswerStats
    chunks: list[Chunk] = field(default_factory=list)
    stitched: Stitched | None = None
    window: ProbeResult | None = None  # the question's queries, captured when eviction is asked for
    selection: Selection | None = None  # the rule's pick and the scores behind it
    prefix_signature: str | None = None  # how the exact prefix cache keeps this turn's KV once decoded (None: not kept)
    prefix_min_hit: int = 0  # a later prompt must share this many tokens to continue from it
    ape: DecodeApe | None = None  # APE over the chunk slots in every decode step (kvrag.model.ape)

    @property
    def logits(self) -> torch.Tensor:
        return self.output.logits


class AnswerStream:
    """An iterator of text pieces; `.stats` and `.text` are complete once it is exhausted."""

    def __init__(self, pieces: Iterator[str], stats: AnswerStats, chunk_ids: list[str]) -> None:
        self._pieces = pieces
        self.stats = stats
        self.chunk_ids = chunk_ids
        self.text = ""

    def __iter__(self) -> Iterator[str]:
        for piece in self._pieces:
            self.text += piece
            yield piece

    def answer(self) -> Answer:
        for _ in self:
            pass
        return Answer(text=self.text.strip(), stats=self.stats, chunk_ids=self.chunk_ids)


class RequestPipeline:
    """Answers one request at a time over a repository's KV with the shared recompute pass."""

    def __init__(self, repo: KVRepository, rotary: Rotary, link_adapter: Callable[[], object],
                 prefix_cache: PrefixCache | None = None, lm: LoadedModel | None = None) -> None:
        """`lm`: the weights that read the stitched prompt and decode, where they are not the ones that
        encoded the chunks (`repo.lm`): a LoRA applied only after the chunks."""
        self.repo = repo
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self.lm = lm if lm is not None else repo.lm
        self.rotary = rotary
        self._link_adapter = link_adapter
        self._default_links: dict[int, torch.Tensor] = {}

    # -- prefill --------------------------------------------------------------------------------
    def prefill(self, question: str | Conversation, resolved: Resolved, opts: AnswerOptions, documents: bool = True) -> Prefill:
        """Everything up to the first token's logits: load, stitch, select, recompute (under the model lock).
        `question`: one question, or a conversation (its last user message is the question);
        `documents=False`: plain chat, the caller's messages alone through the chat template."""
        conv = Conversation.of(question)
        with self.lm.lock, kernel_log() as kernels:
            pre = self._prefill(conv, resolved, opts, documents)
        pre.stats.attention_kernels = kernels
        return pre

    def _prefill(self, conv: Conversation, resolved: Resolved, opts: AnswerOptions, documents: bool, retry: bool = True) -> Prefill:
        t0 = clock(self.lm.device)
        meth = opts.resolved_method()
        stats = AnswerStats(method=meth.name, turns=len(conv.turns))
        reason = opts.whole_reason_for(resolved)
        whole = bool(reason)
        if whole:  # short, or records of one kind: Full Attention (no link slots), and the stats say why
            stats.full_reason = reason
            stats.recompute_ratio = 1.0
            links = LinkSlots()
        else:
            links = meth.prepare(PrepareContext(self.lm, len(resolved.token_ids), self._link_adapter, self._default_links))
        segments = self.repo.layout.conversation_segments(resolved.token_ids, conv, links=links.layout, documents=documents)
        reserve = opts.decode.max_new_tokens + 1
        self.check_length(segments)
        stats.prompt_tokens = segments.total_len
        stats.context_tokens = segments.chunk_tokens
        stats.question_tokens = len(segments.question)
        exact = meth.full_attention or whole
        signature = opts.prefix_signature(exact)
        min_hit = 0 if exact else segments.total_len  # an approximate state is continued whole, never cut
        if signature is not None:
            hit = self.prefix_cache.lookup(signature, segments.all_ids(), floor=len(segments.prefix))
            if hit is not None:
                # an approximate turn kept with APE continues with it over the same chunk slots (the whole
                # earlier prompt is this one's start, so its chunks sit where they sat)
                dape = DecodeApe(opts.ape, len(segments.prefix), segments.context_len) if opts.ape is not None and not exact else None
                with decoding_with(dape):
                    out = full_prefill(self.lm, hit.stack, segments, reserve)
                read_from = max(hit.tokens, len(segments.prefix))
                stats.prefix_hit_tokens = hit.tokens
                stats.recomputed_tokens = stats.chunk_prefill_tokens = max(0, segments.context_len - read_from)
                if exact:
                    stats.recompute_ratio = 1.0
                stats.prefill_s = clock(self.lm.device) - t0
                stats.ttft_s = stats.prefill_s
                selected = torch.arange(read_from, max(read_from, segments.context_len))
                return Prefill(out, segments, selected, stats, resolved.chunks, prefix_signature=signature, prefix_min_hit=min_hit,
                               ape=dape)
        prefix = self.repo.prefix_kv(segments.prefix)

        if exact:
            with self._window(opts.evict, segments) as window:
                out = full_prefill(self.lm, prefix, segments, reserve)
            if window is not None:
                window.key_positions = torch.arange(segments.total_len)
            stats.recomputed_tokens = stats.context_tokens
            stats.chunk_prefill_tokens = stats.context_tokens
            stats.prefill_s = clock(self.lm.device) - t0
            stats.ttft_s = stats.prefill_s
            return Prefill(out, segments, torch.arange(len(segments.prefix), segments.context_len), stats, resolved.chunks, window=window,
                           prefix_signature=signature, prefix_min_hit=min_hit)

        layerwise = self.repo.layerwise_load
        stacks = self.repo.load_chunks(resolved, stats, opts.kv_kind, to_device=not layerwise)
        t1 = clock(self.lm.device)
        stitched = stitch(prefix, stacks, segments, self.rotary, reserve=len(segments.question) + reserve, layerwise=layerwise)
        feed, stats.layerwise = stitched.feed, layerwise
        t2 = clock(self.lm.device)
        try:
            stitched, selection = self._select(meth, stitched, opts, stats)
            t3 = clock(self.lm.device)
            with self._window(opts.evict, segments) as window:
                out = recompute(self.lm, stitched, selection.positions, update=meth.update, link_embeds=links.embeds, ape=opts.ape)
            stitched.ensure_all()  # decoding reads every layer (the pass has ensured each one it updated)
        finally:
            if feed is not None:
                feed.close()
        stitched.feed = None
        # the one check of the stored KV's values: non-finite logits (the first token reads them next
        # anyway) mean a bad entry; those are dropped and the prefill runs again, computing them
        if retry and not bool(torch.isfinite(out.logits).all()) and drop_non_finite(self.repo, resolved, stacks, opts.kv_kind):
            return self._prefill(conv, resolved, opts, documents, retry=False)
        if window is not None:
            window.key_positions = torch.cat([stitched.positions, torch.arange(segments.context_len, segments.total_len)])
        t4 = clock(self.lm.device)
        if feed is not None:
            stats.layer_load_s, stats.load_wait_s = feed.timings()
        stats.stitch_s, stats.select_s, stats.recompute_s = t2 - t1, t3 - t2, t4 - t3
        stats.recomputed_tokens = int(selection.positions.numel())
        stats.ttft_s = t4 - t0 + resolved.read_s  # the store read before the lock counts too
        dape = DecodeApe(opts.ape, *context_slots(stitched)) if opts.ape is not None else None
        stats.ape = opts.ape.tag if opts.ape is not None else ""
        return Prefill(out, segments, selection.positions, stats, resolved.chunks, stitched, window, selection, signature, min_hit, dape)

    def _select(self, meth: Method, stitched: Stitched, opts: AnswerOptions, stats: AnswerStats) -> tuple[Stitched, Selection]:
        """The rule's keep (sparsifying) and select steps. The budget is a share of the chunk tokens held;
        the first chunk's KV is already exact (computed right after the prefix), so a rule selects
        among the other chunks and the first is recomputed only when the budget exceeds them all."""
        # the first chunk's KV is exact only after the prefix it was computed after (not a caller's system message)
        own_prefix = stitched.segments.prefix == list(self.repo.layout.prefix_ids)
        exact = 1 if opts.kv_kind == KIND_CHUNK and own_prefix else 0
        if not meth.probed_layers_only:  # it may read any layer's KV: every layer first
            stitched.ensure_all()
        ctx = SelectContext(self.lm, self.rotary, stitched, exact)
        kept = Selection.of(meth.keep(ctx))
        if kept is not None:
            if kept.positions.numel() < stitched.chunk_positions().numel():  # the cache handed to decoding holds only these
                stitched = stitched.keep(kept.positions)
            ctx = SelectContext(self.lm, self.rotary, stitched, exact, kept.scores)
        held = stitched.chunk_positions()
        stats.kept_kv_ratio = int(held.numel()) / max(1, stats.context_tokens)
        candidates = ctx.candidates()
        if isinstance(opts.recompute_ratio, AutoRatio):
            selection = self._auto_select(meth, ctx, candidates, int(held.numel()), opts.recompute_ratio)
        else:
            budget = token_budget(opts.recompute_ratio, int(held.numel()))
            if opts.recompute_ratio > 0:  # at least min_recompute tokens (an explicit 0 stays Full Reuse)
                budget = max(budget, min(opts.min_recompute_tokens(), int(held.numel())))
            selection = Selection.of(meth.select(ctx, min(budget, int(candidates.numel()))))
            if 0 < candidates.numel() < budget and selection.positions.numel() == candidates.numel():
                # every other chunk token is taken: only then does the budget reach the exact first chunk
                exact_held = held[~torch.isin(held, candidates)][: budget - int(candidates.numel())]
                selection.positions = torch.cat([exact_held, selection.positions.to(exact_held.device)]).sort().values
        stats.recompute_ratio = int(selection.positions.numel()) / max(1, int(held.numel()))
        stats.whole_chunks = selection.whole_chunks
        return stitched, selection

    @staticmethod
    def _auto_select(meth: Method, ctx: SelectContext, candidates: torch.Tensor, held: int, auto: AutoRatio) -> Selection:
        """`recompute_ratio="auto"`: a scoring rule's fewest top tokens holding `auto.mass` of its scores."""
        if not isinstance(meth, ScoredMethod):
            return Selection.of(meth.select(ctx, min(token_budget(auto.fallback, held), int(candidates.numel()))))
        if candidates.numel() == 0:
            return Selection.empty()
        scores = meth.scores(ctx).float().cpu()
        k = auto_budget(scores, held, auto)
        top = torch.topk(scores, k).indices if k else torch.empty(0, dtype=torch.long)
        dense = torch.full((ctx.stitched.segments.context_len,), float("-inf"))
        dense[candidates] = scores
        return Selection(candidates[top].sort().values, dense)

    def stitched(self, resolved: Resolved, segments: Segments) -> Stitched:
        """The stitched context of these chunks laid out as `segments` (store hits; misses computed and kept)."""
        if [list(c) for c in segments.chunks] != resolved.token_ids:
            raise ValueError("segments do not hold these chunks' token ids")
        with self.lm.lock:
            return stitch(self.repo.prefix_kv(segments.prefix), self.repo.load_chunks(resolved, AnswerStats()), segments, self.rotary)

    @contextmanager
    def _window(self, evict: SnapKV | None, segments: Segments) -> Iterator[ProbeResult | None]:
        """Capture the observation window's queries at every layer during a prefill pass."""
        if evict is None:
            yield None
            return
        n_q = len(segments.question)
        w = min(n_q, evict.window or n_q)
        positions = torch.arange(segments.total_len - w, segments.total_len)
        result = ProbeResult(positions=positions, key_positions=torch.empty(0, dtype=torch.long))
        layers = range(len(decoder_of(self.lm.model).layers))
        with capture_queries(self.lm, self.rotary, layers, result, rows=slice(-w, None)):
            yield result

    def check_length(self, segments: Segments, reserve: int = 0) -> None:
        limit = self.lm.max_context
        if segments.total_len + reserve > limit:
            raise ContextTooLongError(
                f"prompt is {segments.total_len} tokens (+{reserve} to generate) but the model's context is {limit}: "
                "retrieve fewer or shorter chunks"
            )

    # -- decode ---------------------------------------------------------------------------------
    def decode(self, pre: Prefill, cfg: DecodeConfig, evict: SnapKV | None = None) -> AnswerStream:
        """Decode from a prefill; `evict` (SnapKV) bounds the cache after the first token."""
        if evict is not None:
            self._evict(pre, evict)
        return AnswerStream(self._tokens(pre, cfg), pre.stats, [c.id for c in pre.chunks])

    def _evict(self, pre: Prefill, evict: SnapKV) -> None:
        if pre.window is None:
            raise ValueError("pass the same evict= to prefill() so the question's queries are captured")
        seg = pre.segments
        protected = (pre.window.key_positions < len(seg.prefix)) | (pre.window.key_positions >= seg.context_len)
        if seg.links:  # KVLink link tokens are kept like the question
            protected |= torch.isin(pre.window.key_positions, torch.tensor(seg.link_positions()))
        with self.lm.lock:
            pre.output.cache = evict.apply(
                pre.output.cache, pre.window.queries, pre.window.scaling, pre.window.positions, pre.window.key_positions, protected
            )
        kept_chunk = cache_kv(pre.output.cache)[0][0].shape[2] - int(protected.sum())
        pre.stats.kept_kv_ratio = min(pre.stats.kept_kv_ratio, kept_chunk / max(1, pre.stats.context_tokens))

    def _tokens(self, pre: Prefill, cfg: DecodeConfig) -> Iterator[str]:
        state = DecodeState()
        t = clock(self.lm.device)
        headers = self.repo.layout.header_lines(pre.chunks)
        tokens = stream_tokens(self.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, self.lm.max_context,
                               headers, pre.segments.read_ids(), pre.ape)
        try:
            while True:  # each forward takes the model lock itself (a batched step: its leader, for all rows)
                piece = next(tokens, None)
                pre.stats.generated_tokens = len(state.token_ids)  # counted as they come: an abandoned answer's too
                if piece is None:
                    break
                yield piece
        finally:  # exhausted, or closed by a consumer that stopped early
            tokens.close()  # the decoder hands its written length back to the cache first
            pre.stats.kv_bytes = cache_nbytes(pre.output.cache)
            pre.stats.decode_s = clock(self.lm.device) - t
            pre.stats.decode_setup_s = state.setup_s
            pre.stats.decode_weights = state.weights
            pre.stats.decode_forwards = state.forwards
            pre.stats.draft_accepted = state.accepted
            pre.stats.echoed_header = state.echoed.strip()
            self._keep_turn(pre, state)

    def _keep_turn(self, pre: Prefill, state: DecodeState) -> None:
        """Keep this turn's KV (prompt + the answer tokens fed back) in the exact prefix cache, so the
        next turn of the conversation (or another question over the same context read whole) reads
        only what follows. Never fails an answer: a problem here is logged and the turn not kept."""
        if pre.prefix_signature is None or not self.prefix_cache.enabled:
            return
        try:
            n = cache_len(pre.output.cache)
            ids = pre.segments.all_ids() + list(state.token_ids)
            if n < pre.segments.total_len or n > len(ids):
                return
            self.prefix_cache.store(pre.prefix_signature, ids[:n], cache_kv(pre.output.cache), pre.prefix_min_hit)
        except Exception as exc:  # noqa: BLE001 (a cache, never the answer's failure)
            log.warning("the prefix cache did not keep this turn: %s", exc)
