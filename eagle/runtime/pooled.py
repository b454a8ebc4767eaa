"""One target forward for sequences whose caches are slots of one ``CachePool`` (``kv_cache``): the
rows of all sequences through each product together and ONE attention call per layer.

``pooled_forward`` is ``segments.segment_forward`` for such caches (same arguments, same result).
Each sequence's rows are padded to the longest segment M ([slots, heads, M, d], the query heads of a
key head as rows of one head: grouped-query attention without repeating keys); keys are read from the
pool's slots, up to the longest sequence's end; one additive mask per attention window
(``batch_biases``): a sequence sees its whole cache and, among its own rows, its tree's ancestors; a
sliding layer's window is applied by positions; padding rows see key 0 alone (their output is
dropped). torch's operations throughout: a row's values equal its sequence's own forward up to
rounding.

``PooledGraphs`` runs the same function on static shapes, captured as CUDA graphs (one replay a
round): every slot of the pool is in the attention's batch, calls are bucketed by rows, segment
length and attended keys, and padding rows write to the pool's scratch slot.

``pooled_drafter_forward`` is the same for a drafter's call (a tree depth of every drafting
sequence), each sequence's rows seeing its committed cache and, of the round's nodes, what its
step's mask allows (``step_blocks``); ``DrafterGraphs`` runs it on static shapes."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from eagle.runtime.layers import with_aux
from eagle.runtime.rows import LayerPlan, gathered, rotary_tables
from eagle.runtime.shapes import (ROW_BUCKETS, SEGMENT_BUCKETS, SPAN_BUCKETS, StaticRunner, StaticShape,  # noqa: F401
                                  bucket_for, keys_for)
from eagle.runtime.masks import additive_bias, host_tensor
from eagle.drafting.drafter import fused_input
from eagle.runtime.kv_cache import CachePool, SlotCache



def batch_biases(windows: Sequence[int | None], group_rows: int, dtype: torch.dtype, sizes: torch.Tensor,
                 pasts: torch.Tensor, block: torch.Tensor, positions: torch.Tensor | None, keys_len: int,
                 spans: torch.Tensor | None = None) -> dict[int | None, torch.Tensor]:
    """The additive masks of a batch of B padded segments of M rows, one per window in ``windows``
    (None: full attention): [B, 1, group_rows M, keys_len], each row repeated for the ``group_rows``
    query heads of a key head. Segment b has ``sizes[b]`` rows; every key before ``pasts[b]`` is seen,
    and of the ``spans[b]`` keys from there (default: its own rows) what ``block`` [B, M, S] (bool)
    allows (a tree's ancestors; causal for a chain); ``positions`` [B, M] (S = M; only for windows):
    each row's position. Within the window of a sliding layer (a cached key's position is its slot;
    a row's key, its row's position); padding rows see key 0 alone. Device operations only
    (capturable), the same whatever the batch."""
    members, m, span = block.shape
    device = block.device
    rel = torch.arange(keys_len, device=device)[None] - pasts[:, None]  # [B, Lk]: key j's place after the past
    at = rel.clamp(0, span - 1)
    mine = (rel >= 0) & (rel < (sizes if spans is None else spans)[:, None])
    allowed = (rel < 0)[:, None] | mine[:, None] & block.gather(2, at[:, None].expand(members, m, keys_len))
    valid = torch.arange(m, device=device)[None] < sizes[:, None]  # [B, M]
    allowed = allowed & valid[:, :, None]  # [B, M, Lk]
    padding = (~valid)[:, :, None] & (torch.arange(keys_len, device=device) == 0)  # key 0 for padding rows
    out = {}
    for window in set(windows):
        seen = allowed
        if window is not None:
            key_pos = torch.where(rel < 0, rel + pasts[:, None], positions.gather(1, at))  # [B, Lk]
            seen = allowed & (positions[:, :, None] - key_pos[:, None] < window)
        out[window] = additive_bias(seen | padding, dtype).repeat(1, 1, group_rows, 1)
    return out


def tree_blocks(members: int, m: int, places: Sequence[int], sizes: Sequence[int], masks: Sequence[torch.Tensor | None],
                device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """``batch_biases``' ``block`` [B, M, M] on ``device``: causal, then segment s's rows at place
    ``places[s]`` as its mask allows among them: an additive mask [1, 1, n, K] (its last n columns, K >= n),
    or a bool one [n, n] (True: seen; a tree's ``TreeAttention.mask`` as it is); None: causal. Written into
    ``out`` when given. Built on the host and copied once when the masks are there, else one copy per
    tree on the device."""
    host = all(mask is None or mask.device.type == "cpu" for mask in masks)
    causal = torch.ones(m, m, dtype=torch.bool, device="cpu" if host else device).tril()
    block = causal.expand(members, m, m).clone()
    for place, n, mask in zip(places, sizes, masks):
        if mask is not None:
            block[place, :n, :n] = mask if mask.dtype == torch.bool else mask[0, 0, :, mask.shape[-1] - n:] == 0
    return block.to(device) if out is None else out.copy_(block)


def attention_step(pool: CachePool, nh: int, scale: float, slots: torch.Tensor, batch: torch.Tensor,
                   rows: torch.Tensor, places: torch.Tensor, members: torch.Tensor | int, m: int, keys_len: int,
                   biases: dict, windows: Sequence[int | None]) -> Callable:
    """``each_layer``'s ``attend`` over the pool: layer i's new keys and values (rows [R]) written to
    their slots at ``places``, the queries padded into [B, heads, M, d] at (``batch``, ``rows``), one
    SDPA over the batch's slots (``members``: B, the pool's first B slots; or a tensor of slots to
    gather), the rows' outputs [1, R, heads d] read back."""
    kv = pool.kv
    nkv, d = kv.shape[3], kv.shape[5]
    b = members if isinstance(members, int) else members.shape[0]

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [1, heads, R, d]
        keys, values = kv[0, i], kv[1, i]  # [slots, kv_heads, capacity, d]
        keys[slots, :, places] = k[0].transpose(0, 1)
        values[slots, :, places] = v[0].transpose(0, 1)
        if isinstance(members, int):
            keys, values = keys[:members, :, :keys_len], values[:members, :, :keys_len]
        else:
            keys, values = keys[members, :, :keys_len], values[members, :, :keys_len]
        padded = q.new_zeros(b, nh, m, d)
        padded[batch, :, rows] = q[0].transpose(0, 1)
        out = F.scaled_dot_product_attention(padded.view(b, nkv, nh // nkv * m, d), keys, values,
                                             attn_mask=biases[windows[i]], scale=scale)  # [B, kv, group M, d]
        return out.reshape(b, nh, m, d)[batch, :, rows].reshape(1, -1, nh * d)

    return attend


def row_index(caches: Sequence[SlotCache], pasts: Sequence[int], sizes: Sequence[int],
              place: Callable[[int], int]) -> torch.Tensor:
    """[4, R] on the host: each row's slot, its place in the attention's batch (``place(slot)``), its row in its
    segment and its cache position, the sequences' rows one after another."""
    slots: list[int] = []
    places: list[int] = []
    rows: list[int] = []
    positions: list[int] = []
    for cache, past, n in zip(caches, pasts, sizes):  # whole runs at a time: a batch of 64 trees has ~1000 rows
        slots += [cache.slot] * n
        places += [place(cache.slot)] * n
        rows += range(n)
        positions += range(past, past + n)
    return host_tensor(slots + places + rows + positions).view(4, -1)


def segment_table(members: int, places: Sequence[int], sizes: Sequence[int], pasts: Sequence[int]) -> torch.Tensor:
    """[2, B] on the host: each place's segment size and cached length (0 where no sequence of the call sits)."""
    table = torch.zeros(2, members, dtype=torch.long)
    table[:, list(places)] = torch.tensor([list(sizes), list(pasts)])
    return table


def pooled_layers(lean: Any, pool: CachePool, x: torch.Tensor, rope: dict, pos: torch.Tensor, index: torch.Tensor,
                  table: torch.Tensor, block: torch.Tensor, members: torch.Tensor | int, keys_len: int,
                  aux_layers: Sequence[int]) -> torch.Tensor:
    """The layers over the rows x [1, R, H] at positions ``pos`` [R] (rotary tables ``rope``, [1, 1, R, d]
    each), ``index`` [4, R] (``row_index``), ``table`` [2, B] (``segment_table``), ``block`` [B, M, M]
    (``tree_blocks``), the attention's batch ``members`` (``attention_step``) -> final-norm features followed
    by layers ``aux_layers``' outputs [R, (1 + n) H]. Device operations only (capturable)."""
    plan = LayerPlan.of(lean)
    b, m = block.shape[:2]
    positions = torch.zeros(b, m, dtype=pos.dtype, device=pos.device)
    positions[index[1], index[2]] = pos
    biases = batch_biases(plan.windows, lean.num_heads // lean.num_kv_heads, pool.kv.dtype, table[0], table[1],
                          block, positions, keys_len)
    attend = attention_step(pool, lean.num_heads, plan.scale, index[0], index[1], index[2], index[3], members, m,
                            keys_len, biases, plan.windows)
    return with_aux(lean, x, rope, attend, aux_layers)[0]


def extended(caches: Sequence[SlotCache], sizes: Sequence[int]) -> tuple[CachePool, list[int]]:
    """The pool of ``caches`` (slots of one ``CachePool``) and their lengths before a call: each cache is
    extended by its ``sizes`` rows (counted as written: the attention writes them) and the pool's deferred
    compactions are applied."""
    pool = caches[0].pool
    if any(c.pool is not pool for c in caches):
        raise ValueError("a pooled call takes caches of one pool")
    pasts = [c.get_seq_length() for c in caches]
    for cache, n in zip(caches, sizes):
        cache.take(n)
    pool.flush()
    return pool, pasts


def attention_batch(caches: Sequence[SlotCache], pasts: Sequence[int], sizes: Sequence[int], members: Sequence[int],
                    device: torch.device) -> tuple[list[int], torch.Tensor, int]:
    """An eager call's layout over the attention's batch ``members`` (slots): each sequence's place in it,
    ``row_index`` [4, R] on ``device``, and the keys read (the longest sequence's end rounded up to 16; keys
    past a sequence's end are masked)."""
    where = {slot: b for b, slot in enumerate(members)}
    index = row_index(caches, pasts, sizes, where.__getitem__).to(device)
    keys_len = min(caches[0].pool.capacity, -(-max(p + n for p, n in zip(pasts, sizes)) // 16) * 16)
    return [where[c.slot] for c in caches], index, keys_len


@torch.inference_mode()
def pooled_forward(lean: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, caches: Sequence[SlotCache],
                   sizes: Sequence[int], masks: Sequence[torch.Tensor | None],
                   aux_layers: Sequence[int] = ()) -> torch.Tensor:
    """``segment_forward`` over caches that are slots of one ``CachePool`` (``masks``: each sequence
    sees its whole cache; their last n columns are used, or bool [n, n] masks as ``tree_blocks`` takes
    them). Runs on the pool's ``PooledGraphs`` when it
    has one and the call fits its buckets; else eagerly, the attention's batch being the pool's slots 0
    .. top - 1 read in place when these sequences are at least half of them (a round of the running
    batch), else these sequences' slots gathered (prompts joining a long batch)."""
    pool, pasts = extended(caches, sizes)
    if pool.graphs is not None and pool.graphs.fits(sizes):
        return pool.graphs(input_ids, position_ids, caches, pasts, sizes, masks, tuple(aux_layers))
    device = input_ids.device
    m = max(sizes)
    top = pool.top
    in_place = 2 * len(caches) >= top
    members = list(range(top)) if in_place else sorted(c.slot for c in caches)  # the attention's batch
    places, index, keys_len = attention_batch(caches, pasts, sizes, members, device)
    table = segment_table(len(members), places, sizes, pasts).to(device)
    block = tree_blocks(len(members), m, places, sizes, masks, device)
    x = lean.embed(input_ids)[None]  # [1, R, H]
    if hasattr(lean, "layer_types"):  # Gemma-3: a rotary table per layer type
        rope = {t: tuple(c[:, None] for c in lean.rotary(x, position_ids[None], t)) for t in lean.layer_types}
    else:
        rope = {None: tuple(c[:, None] for c in lean.rotary(x, position_ids[None]))}  # [1, 1, R, d]
    gather = len(members) if in_place else torch.tensor(members, device=device)
    return pooled_layers(lean, pool, x, rope, position_ids, index, table, block, gather, keys_len, aux_layers)


class _Static(StaticRunner):
    """Static shapes over a ``CachePool`` (``StaticRunner``'s capture, replay and fallback counting). A pool
    that grows (a new buffer) drops its shapes; ``rope``: the rotary tables for the pool's positions, made
    again with them (``tables``)."""

    def __init__(self, pool: CachePool, capture: bool = True) -> None:
        super().__init__(pool.kv.device, capture)
        self.pool = pool
        self.buffer: torch.Tensor | None = None  # the pool's buffer the shapes were made for
        self.rope: dict = {}

    def tables(self) -> dict:
        raise NotImplementedError

    def shape_of(self, rows: int, pasts: Sequence[int], sizes: Sequence[int]) -> tuple[int, int, int]:
        """A call's (row bucket, segment bucket, keys read: ``shapes.keys_for``)."""
        return (bucket_for(rows, ROW_BUCKETS), bucket_for(max(sizes), SEGMENT_BUCKETS),
                keys_for(max(p + n for p, n in zip(pasts, sizes)), self.pool.capacity))

    def index_of(self, caches: Sequence[SlotCache], pasts: Sequence[int], sizes: Sequence[int],
                 rows: int) -> torch.Tensor:
        """``row_index`` [4, rows] on the host for a static call (places are slots), the real rows first, then
        padding rows: position 0 of the scratch slot, segment row 0."""
        scratch = self.pool.scratch
        index = torch.tensor([scratch, scratch, 0, 0])[:, None].repeat(1, rows)
        index[:, :sum(sizes)] = row_index(caches, pasts, sizes, lambda slot: slot)
        return index

    def run(self, key: tuple, make: Callable[[], StaticShape], fill: Callable[[StaticShape], None]) -> torch.Tensor:
        """``StaticRunner.run``, the shapes dropped and the tables made again when the pool has a new buffer."""
        if self.buffer is not self.pool.kv:  # a new buffer: the graphs read the old one
            self.shapes.clear()
            self.buffer = self.pool.kv
            with torch.inference_mode():
                self.rope = self.tables()
        return super().run(key, make, fill)


class PooledGraphs(_Static):
    """``pooled_forward`` on static shapes, one CUDA graph per shape replayed each round. A call of R rows
    in segments of at most M rows attending to at most Lk keys runs the static function of (the row
    bucket >= R, the segment bucket >= M, Lk a power of two >= 64: ``shapes.keys_for``, the aux layers): its
    attention's batch is every slot of the pool, scratch included; padding rows (token 0 at position
    0) write to the scratch slot. Inputs are filled by two copies and one copy per tree."""

    def __init__(self, lean: Any, pool: CachePool, capture: bool = True) -> None:
        super().__init__(pool, capture)
        self.lean = lean

    def fits(self, sizes: Sequence[int]) -> bool:
        """Whether a call of segments of ``sizes`` rows runs on a static shape."""
        return max(sizes) <= SEGMENT_BUCKETS[-1] and sum(sizes) <= ROW_BUCKETS[-1]

    def tables(self) -> dict:
        return rotary_tables(self.lean, self.pool.capacity, self.pool.kv.device, self.pool.kv.dtype)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, caches: Sequence[SlotCache],
                 pasts: Sequence[int], sizes: Sequence[int], masks: Sequence[torch.Tensor | None],
                 aux_layers: tuple[int, ...]) -> torch.Tensor:
        """``pooled_forward``'s result [R, (1 + n) H] for caches already extended (``take``) from ``pasts``."""
        r = len(input_ids)
        key = self.shape_of(r, pasts, sizes) + (aux_layers,)
        return self.run(("pooled",) + key, lambda: self._make(*key),
                        lambda shape: self._fill(shape, input_ids, position_ids, caches, pasts, sizes, masks))[:r]

    def _make(self, rows: int, m: int, keys_len: int, aux_layers: tuple[int, ...]) -> StaticShape:
        lean, pool = self.lean, self.pool
        device, slots = pool.kv.device, pool.kv.shape[2]
        inputs = dict(tokens=torch.zeros(2, rows, dtype=torch.long, device=device),  # ids, positions
                      index=torch.zeros(4, rows, dtype=torch.long, device=device),  # ``row_index``
                      table=torch.zeros(2, slots, dtype=torch.long, device=device),  # ``segment_table``
                      block=torch.zeros(slots, m, m, dtype=torch.bool, device=device))

        def run() -> torch.Tensor:
            ids, pos = inputs["tokens"]
            return pooled_layers(lean, pool, lean.embed(ids)[None], gathered(self.rope, pos, (1, 1, rows)), pos,
                                 inputs["index"], inputs["table"], inputs["block"], slots, keys_len, aux_layers)

        return StaticShape(inputs, run)

    def _fill(self, shape: StaticShape, input_ids: torch.Tensor, position_ids: torch.Tensor,
              caches: Sequence[SlotCache], pasts: Sequence[int], sizes: Sequence[int],
              masks: Sequence[torch.Tensor | None]) -> None:
        """The static inputs of this call: real rows first, padding rows (token 0 at position 0, cache
        position 0 of the scratch slot, its segment row 0) after; segment sizes and pasts per slot (0 for
        slots not in the call); each tree's block."""
        inputs, r = shape.inputs, len(input_ids)
        tokens = inputs["tokens"]
        tokens[0, :r], tokens[1, :r] = input_ids, position_ids
        tokens[:, r:] = 0
        slots = [c.slot for c in caches]
        inputs["index"].copy_(self.index_of(caches, pasts, sizes, tokens.shape[1]))
        inputs["table"].copy_(segment_table(inputs["table"].shape[1], slots, sizes, pasts))
        tree_blocks(inputs["block"].shape[0], inputs["block"].shape[1], slots, sizes, masks, inputs["block"].device,
                    out=inputs["block"])


def step_blocks(members: int, m: int, span: int, places: Sequence[int], pasts: Sequence[int], sizes: Sequence[int],
                seen: Sequence[torch.Tensor | None] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pooled drafter call's masks in ``batch_biases``' terms: [3, B] on the host (each place's keys seen
    whole, its rows, its span: 0 where no sequence sits) and ``block`` [B, M, span]. Segment s (at place
    ``places[s]``, ``sizes[s]`` rows after ``pasts[s]`` cached) sees every key but its last S and of those
    what ``seen[s]`` (bool [n, S], a ``DraftStep``'s) allows; None: causal (S = n). ``seen`` one tensor
    [B, n, S] (every segment n rows: ``batch_trees``' calls): both made where it is (``uniform_blocks``)."""
    if isinstance(seen, torch.Tensor):
        return uniform_blocks(members, m, span, torch.tensor(list(places), device=seen.device),
                              torch.tensor(list(pasts), device=seen.device), seen)
    table = [[0] * members for _ in range(3)]
    block = torch.zeros(members, m, span, dtype=torch.bool)
    for place, past, n, mask in zip(places, pasts, sizes, seen):
        width = n if mask is None else mask.shape[1]
        table[0][place], table[1][place], table[2][place] = past + n - width, n, width
        block[place, :n, :width] = torch.ones(n, n, dtype=torch.bool).tril() if mask is None else mask
    return torch.tensor(table), block


def uniform_blocks(members: int, m: int, span: int, places: torch.Tensor, pasts: torch.Tensor,
                   seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``step_blocks``' table [3, members] and block [members, m, span] where every segment has n rows, on
    ``seen``'s device: segment b at place ``places[b]``, its rows written after ``pasts[b]`` cached keys, sees
    every key but its last S and of those what ``seen`` [B, n, S] allows. Device operations only
    (capturable)."""
    n, width = seen.shape[1:]
    table = torch.zeros(3, members, dtype=torch.long, device=seen.device)
    table[:, places] = torch.stack([pasts + n - width, torch.full_like(pasts, n), torch.full_like(pasts, width)])
    block = torch.zeros(members, m, span, dtype=torch.bool, device=seen.device)
    block[places, :n, :width] = seen
    return table, block


def step_spans(sizes: Sequence[int], seen: Sequence[torch.Tensor | None] | torch.Tensor) -> list[int]:
    """Each segment's span of keys its ``seen`` mask covers (its rows where causal)."""
    if isinstance(seen, torch.Tensor):
        return [seen.shape[2]] * len(sizes)
    return [n if mask is None else mask.shape[1] for n, mask in zip(sizes, seen)]


def drafter_attention(drafter: Any, pool: CachePool, index: torch.Tensor, table: torch.Tensor, block: torch.Tensor,
                      members: torch.Tensor | int, keys_len: int) -> Callable:
    """``LeanDrafter.layers_with``'s ``attend`` over the drafter's pool for a call laid out by ``row_index``
    (``index`` [4, R]) and ``step_blocks`` (``table``, ``block``, on the device). Device operations only."""
    cfg = drafter.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    bias = batch_biases([None], group, pool.kv.dtype, table[1], table[0], block, None, keys_len, spans=table[2])
    return attention_step(pool, cfg.num_attention_heads, cfg.head_dim ** -0.5, index[0], index[1], index[2],
                          index[3], members, block.shape[1], keys_len, bias, [None] * cfg.num_layers)


@torch.inference_mode()
def pooled_drafter_forward(drafter: Any, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                           caches: Sequence[SlotCache], sizes: Sequence[int],
                           seen: Sequence[torch.Tensor | None] | torch.Tensor) -> torch.Tensor:
    """A drafter (``LeanDrafter``) call for several sequences whose drafter caches are slots of one
    ``CachePool``: ``features``/``token_embeds`` [R, H] and ``positions`` [R], the sequences' rows one after
    another (``sizes``), sequence s's rows appended to ``caches[s]`` and attending to it as ``seen[s]`` allows
    (``step_blocks``; None: causal; or one tensor for all) -> the predicted features [R, H]. ONE attention call
    per layer for all sequences (``attention_step``), the products over all rows together; on the pool's
    ``DrafterGraphs`` where it has them and the call fits."""
    pool, pasts = extended(caches, sizes)
    if pool.graphs is not None and pool.graphs.fits(sizes, step_spans(sizes, seen)):
        return pool.graphs(features, token_embeds, positions, caches, pasts, sizes, seen)
    device, m = features.device, max(sizes)
    members = sorted(c.slot for c in caches)
    places, index, keys_len = attention_batch(caches, pasts, sizes, members, device)
    table, block = step_blocks(len(members), m, max(step_spans(sizes, seen)), places, pasts, sizes, seen)
    attend = drafter_attention(drafter, pool, index, table.to(device), block.to(device),
                               torch.tensor(members, device=device), keys_len)
    x = fused_input(drafter.fc, features[None], token_embeds[None], drafter.config)
    cos, sin = drafter.rotary(positions[None])
    return drafter.layers_with(x, token_embeds[None], cos, sin, attend)[0]


class DrafterGraphs(_Static):
    """``pooled_drafter_forward`` on static shapes, one CUDA graph per shape replayed at each call (a tree
    depth of a round): a call of R rows in segments of at most M rows whose masks span at most S keys,
    attending to at most Lk keys, runs the static function of (the row bucket >= R, the segment bucket >= M,
    the span bucket >= S, Lk as ``PooledGraphs``', the input width); its attention's batch is every slot of
    the pool, scratch included; padding rows write to the scratch slot. Inputs are filled by two copies on
    the device (features, embeddings) and one from the host per kind. A pool that grows drops its graphs."""

    def __init__(self, drafter: Any, pool: CachePool, capture: bool = True) -> None:
        super().__init__(pool, capture)
        self.drafter = drafter

    def fits(self, sizes: Sequence[int], spans: Sequence[int]) -> bool:
        """Whether a call of segments of ``sizes`` rows spanning ``spans`` keys runs on a static shape."""
        return max(sizes) <= SEGMENT_BUCKETS[-1] and sum(sizes) <= ROW_BUCKETS[-1] and max(spans) <= SPAN_BUCKETS[-1]

    def tables(self) -> dict:
        cos, sin = self.drafter.rotary(torch.arange(self.pool.capacity, device=self.pool.kv.device)[None])
        return {None: (cos[0, 0], sin[0, 0])}  # the drafter's own tables [capacity, d]

    def __call__(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                 caches: Sequence[SlotCache], pasts: Sequence[int], sizes: Sequence[int],
                 seen: Sequence[torch.Tensor | None] | torch.Tensor) -> torch.Tensor:
        """``pooled_drafter_forward``'s result [R, H] for caches already extended (``take``) from ``pasts``."""
        r = len(positions)
        rows, m, keys_len = self.shape_of(r, pasts, sizes)
        key = (rows, m, bucket_for(max(step_spans(sizes, seen)), SPAN_BUCKETS), keys_len, features.shape[1])

        def fill(shape: StaticShape) -> None:
            inputs = shape.inputs
            inputs["features"][:r] = features
            inputs["embeds"][:r] = token_embeds
            inputs["positions"][:r] = positions
            if r < rows:
                inputs["positions"][r:] = 0
            table, block = step_blocks(self.pool.kv.shape[2], m, key[2], [c.slot for c in caches], pasts, sizes, seen)
            inputs["index"].copy_(self.index_of(caches, pasts, sizes, rows))
            inputs["table"].copy_(table)
            inputs["block"].copy_(block)

        return self.run(("drafter",) + key, lambda: self._make(*key), fill)[:r]

    def _make(self, rows: int, m: int, span: int, keys_len: int, width: int) -> StaticShape:
        drafter, pool = self.drafter, self.pool
        device, slots = pool.kv.device, pool.kv.shape[2]
        h = drafter.config.hidden_size
        inputs = dict(features=torch.zeros(rows, width, dtype=drafter.dtype, device=device),
                      embeds=torch.zeros(rows, h, dtype=drafter.dtype, device=device),
                      positions=torch.zeros(rows, dtype=torch.long, device=device),
                      index=torch.zeros(4, rows, dtype=torch.long, device=device),  # ``row_index``
                      table=torch.zeros(3, slots, dtype=torch.long, device=device),  # ``step_blocks``
                      block=torch.zeros(slots, m, span, dtype=torch.bool, device=device))

        def run() -> torch.Tensor:
            return self.call_rows(inputs["features"], inputs["embeds"], inputs["positions"], inputs["index"],
                                  inputs["table"], inputs["block"], keys_len)

        return StaticShape(inputs, run)

    def call_rows(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, index: torch.Tensor,
                  table: torch.Tensor, block: torch.Tensor, keys_len: int) -> torch.Tensor:
        """The drafter over rows ``features`` [R, W], ``embeds`` [R, H] at ``positions`` [R], laid out by
        ``index`` (``row_index``, places being slots), ``table`` and ``block`` (``step_blocks``'), attending
        to the first ``keys_len`` keys of the pool's slots -> [R, H]. Device operations only."""
        drafter = self.drafter
        cos, sin = gathered(self.rope, positions, (1, 1, positions.shape[0]))[None]
        attend = drafter_attention(drafter, self.pool, index, table, block, self.pool.kv.shape[2], keys_len)
        x = fused_input(drafter.fc, features[None], embeds[None], drafter.config)
        return drafter.layers_with(x, embeds[None], cos, sin, attend)[0]

    def step_rows(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  starts: torch.Tensor, seen: torch.Tensor, span: int, keys_len: int) -> torch.Tensor:
        """A drafter call inside a static function, its layout made on the device: each of B sequences (slot
        ``slots`` [B]; a padding one at the scratch slot) writes n rows (``features``/``embeds`` [B n, .] at
        ``positions`` [B n], by sequence) at cache positions ``starts`` [B] on, and sees every key before its
        last S and of those what ``seen`` [B, n, S] allows (S <= ``span``, the block's width) -> [B n, H]."""
        b, n = seen.shape[:2]
        row = torch.arange(n, device=seen.device)
        row_slots = slots.repeat_interleave(n)
        index = torch.stack([row_slots, row_slots, row.repeat(b), (starts[:, None] + row).reshape(-1)])
        table, block = uniform_blocks(self.pool.kv.shape[2], bucket_for(n, SEGMENT_BUCKETS), span, slots,
                                      starts, seen)
        return self.call_rows(features, embeds, positions, index, table, block, keys_len)
