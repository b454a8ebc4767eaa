"""KV-cache bookkeeping shared by every method: roll back and compact.

Two kinds of cache: transformers' ``DynamicCache`` (layers hold ``keys``/``values``
[B, heads, T, d]), used with a target's own forward, and ``StaticCache``, preallocated and
written by position, used by the lean target forward (``eagle.runtime.decoder``) and by the drafter."""

from __future__ import annotations

import functools
import heapq
import inspect
from typing import Any

import torch

from eagle.errors import EagleError
from eagle.runtime.kernels import cpu_kernels

_MIN_CAPACITY = 256


class StaticCache:
    """Keys/values per layer in preallocated buffers [B, kv_heads, capacity, head_dim].
    ``update`` writes at the layer's current length, no concatenation; a buffer doubles when a
    write would overflow it. Rolling back or compacting moves lengths and copies the kept rows."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers

    def get_seq_length(self) -> int:
        return self.lengths[0]

    def update(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``keys``/``values`` [B, kv_heads, q, d] to layer ``index``; return views of all
        its entries [B, kv_heads, length + q, d]."""
        start = self.reserve(index, keys)
        end = self.lengths[index]
        self.keys[index][..., start:end, :] = keys
        self.values[index][..., start:end, :] = values
        return self.keys[index][..., :end, :], self.values[index][..., :end, :]

    def reserve(self, index: int, like: torch.Tensor) -> int:
        """Make room in layer ``index`` for ``like.shape[-2]`` more positions (``like``: keys
        [B, kv_heads, q, d], or any tensor of that shape and dtype), count them as written, and
        return where they start; the caller writes them into ``keys[index]``/``values[index]``."""
        start = self.lengths[index]
        end = start + like.shape[-2]
        buf = self.keys[index]
        if buf is None or end > buf.shape[-2]:
            capacity = max(_MIN_CAPACITY, 1 << (end - 1).bit_length())
            self.keys[index] = self._grown(buf, like, capacity, start)
            self.values[index] = self._grown(self.values[index], like, capacity, start)
        self.lengths[index] = end
        return start

    def reserve_layers(self, like: torch.Tensor) -> int:
        """``reserve`` in every layer, for a forward that writes every layer's keys and values itself
        (``eagle.runtime.decoder.decoder_stack``); returns where they start, the same in every layer."""
        starts = {self.reserve(index, like) for index in range(len(self.keys))}
        if len(starts) != 1:
            raise EagleError(f"the cache's layers hold different lengths: {sorted(starts)}")
        return starts.pop()

    @staticmethod
    def _grown(buf: torch.Tensor | None, like: torch.Tensor, capacity: int, keep: int) -> torch.Tensor:
        new = like.new_empty(*like.shape[:-2], capacity, like.shape[-1])
        if buf is not None and keep:
            new[..., :keep, :] = buf[..., :keep, :]
        return new

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` [R] (e.g. the sequences still generating)."""
        for buffers in (self.keys, self.values):
            for i, buf in enumerate(buffers):
                if buf is not None:
                    buffers[i] = buf.index_select(0, rows.to(buf.device))

    def truncate(self, length: int) -> None:
        self.lengths = [min(n, length) for n in self.lengths]

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move the entries at positions ``keep`` [m] (increasing, all >= start) to start .. start + m - 1
        in every layer and drop the rest (in one compiled call on a CPU where the kernels run)."""
        m = keep.shape[0]
        buffers = [buf for bufs in (self.keys, self.values) for i, buf in enumerate(bufs)
                   if buf is not None and self.lengths[i]]
        kernels = cpu_kernels()
        if kernels is not None and all(buf.device.type == "cpu" and buf.is_contiguous() for buf in buffers):
            kernels.compact_rows(buffers, start, keep.tolist())
        else:
            for buf in buffers:
                buf[..., start:start + m, :] = buf.index_select(-2, keep.to(buf.device))
        self.truncate(start + m)


class CachePool:
    """The caches of up to ``slots`` sequences in one buffer ``kv`` [2, layers, slots + 1, kv_heads,
    capacity, head_dim] (keys, then values), so that one attention call per layer reads them all
    (``eagle.runtime.pooled``). ``cache()`` hands a free slot out as a ``SlotCache``; the last slot,
    ``scratch``, is never handed out (padding rows of a static call write there). The capacity doubles
    (every slot copied into a new buffer) when a sequence would outgrow it. Compactions are deferred and
    applied to every slot at once (``flush``: one gather and one scatter for all layers) before the
    buffer is next read. Unused positions hold finite values (zeros at first), so masked keys weigh
    exactly 0. ``graphs``: a ``pooled.PooledGraphs`` the forward runs on, if any."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = _MIN_CAPACITY) -> None:
        self.kv = torch.zeros(2, num_layers, slots + 1, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.scratch = slots
        self.graphs: Any = None
        self._free = list(range(slots))
        self._used: set[int] = set()
        self._moves: list[tuple[int, int, torch.Tensor]] = []  # (slot, start, kept positions)
        self._moved: set[int] = set()  # the slots of ``_moves``
        self._views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    @property
    def capacity(self) -> int:
        return self.kv.shape[-2]

    @property
    def top(self) -> int:
        """One past the highest slot in use: attention reads slots 0 .. top - 1."""
        return max(self._used, default=-1) + 1

    def cache(self) -> "SlotCache":
        """An empty cache in the lowest free slot (an ``EagleError`` when every slot is in use)."""
        if not self._free:
            raise EagleError(f"all {self.scratch} slots of the cache pool are in use")
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return SlotCache(self, slot)

    def release(self, cache: "SlotCache") -> None:
        """Give ``cache``'s slot back (what it holds is overwritten by the next sequence)."""
        if cache.slot in self._used:
            self._used.remove(cache.slot)
            heapq.heappush(self._free, cache.slot)
            self._moves = [m for m in self._moves if m[0] != cache.slot]
            self._moved.discard(cache.slot)

    def grow(self, end: int) -> None:
        """Make room for ``end`` positions in every slot (capacity doubled until it fits)."""
        if end <= self.capacity:
            return
        self.flush()
        capacity = 1 << (end - 1).bit_length()
        grown = self.kv.new_zeros(*self.kv.shape[:-2], capacity, self.kv.shape[-1])
        grown[..., :self.capacity, :] = self.kv
        self.kv = grown
        self._views.clear()

    def views(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Slot ``slot``'s keys and values per layer, views [1, kv_heads, capacity, d] of ``kv``."""
        if slot not in self._views:
            self._views[slot] = tuple([self.kv[j, i, slot:slot + 1] for i in range(self.kv.shape[1])]
                                      for j in (0, 1))
        return self._views[slot]

    def defer_compact(self, slot: int, start: int, keep: torch.Tensor) -> None:
        """Queue a compaction of ``slot`` (``StaticCache.compact``'s), applied by the next ``flush``; none
        where it moves nothing (a host ``keep`` of one position, ``start``: a round that kept its root alone)."""
        if keep.device.type == "cpu" and keep.shape[0] == 1 and int(keep[0]) == start:
            return
        if slot in self._moved:  # a second move reads what the first wrote
            self.flush()
        self._moves.append((slot, start, keep))
        self._moved.add(slot)

    def flush(self) -> None:
        """Apply the deferred compactions: in every slot and layer, the entries at a move's kept
        positions go to start .. start + m - 1 (gathered before any is written)."""
        if not self._moves:
            return
        moves, self._moves = self._moves, []
        self._moved.clear()
        device = self.kv.device
        if all(keep.device.type == "cpu" for _, _, keep in moves):  # one copy to the device for all moves
            index = torch.tensor([[slot, start + j, src] for slot, start, keep in moves
                                  for j, src in enumerate(keep.tolist())]).T.to(device)
            slots, dst, src = index
        else:
            slots = torch.tensor([slot for slot, _, keep in moves for _ in range(keep.shape[0])], device=device)
            dst = torch.tensor([start + j for _, start, keep in moves for j in range(keep.shape[0])], device=device)
            src = torch.cat([keep.to(device) for _, _, keep in moves])
        self.kv[:, :, slots, :, dst] = self.kv[:, :, slots, :, src]  # [moved, 2, layers, kv_heads, d]


class SlotCache(StaticCache):
    """One sequence's cache in a ``CachePool``: a ``StaticCache`` whose layers' buffers are views of its
    slot [1, kv_heads, capacity, d]. Reading them applies the pool's deferred compactions first;
    ``compact`` defers its move to the pool (``flush``)."""

    gathers = True  # ``compact`` needs no look from the host

    def __init__(self, pool: CachePool, slot: int) -> None:
        self.pool, self.slot = pool, slot
        self.lengths = [0] * pool.kv.shape[1]

    @property
    def keys(self) -> list[torch.Tensor]:
        self.pool.flush()
        return self.pool.views(self.slot)[0]

    @property
    def values(self) -> list[torch.Tensor]:
        self.pool.flush()
        return self.pool.views(self.slot)[1]

    def reserve(self, index: int, like: torch.Tensor) -> int:
        start = self.lengths[index]
        self.pool.grow(start + like.shape[-2])
        self.lengths[index] = start + like.shape[-2]
        return start

    def take(self, n: int) -> int:
        """Count ``n`` more positions as written in every layer (the caller writes them into the pool's
        buffer); returns where they start."""
        start = self.get_seq_length()
        self.pool.grow(start + n)
        self.lengths = [start + n] * len(self.lengths)
        return start

    def keep_rows(self, rows: torch.Tensor) -> None:
        raise EagleError("a pooled cache holds one sequence: it has no batch rows to keep")

    def compact(self, start: int, keep: torch.Tensor) -> None:
        self.pool.defer_compact(self.slot, start, keep)
        self.truncate(start + keep.shape[0])


def new_cache(model: Any, role: str = "target") -> Any:
    """An empty ``DynamicCache`` for ``model``. Sliding-window layers are refused: they keep
    fewer keys than the tree masks cover and cannot be rolled back."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise EagleError(f"the {role} uses sliding-window attention, which eagle does not support yet")
    return cache


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """``cache`` as the keyword ``model``'s forward takes it: ``cache`` from transformers 5.x versions
    that renamed it (``past_key_values`` is deprecated there and goes in 5.40), else ``past_key_values``."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def roll_back(cache: Any, length: int) -> None:
    """Drop everything after the first ``length`` positions."""
    if isinstance(cache, StaticCache):
        cache.truncate(length)
        return
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


@torch.inference_mode()
def compact(cache: Any, start: int, keep: torch.Tensor) -> None:
    """Move the entries at absolute positions ``keep`` [m] (all >= start, increasing) to
    ``start .. start + m - 1`` and drop the rest: the accepted tree path becomes contiguous."""
    if getattr(cache, "gathers", False):  # one gather on the device costs less than a look from the host
        cache.compact(start, keep)
        return
    m = keep.shape[0]
    contiguous = bool(torch.equal(keep.cpu(), torch.arange(start, start + m)))
    if contiguous:
        roll_back(cache, start + m)
    elif isinstance(cache, StaticCache):
        cache.compact(start, keep)
    else:
        for layer in cache.layers:
            if getattr(layer, "keys", None) is None or not layer.keys.numel():
                continue
            idx = keep.to(layer.keys.device)
            layer.keys[..., start:start + m, :] = layer.keys.index_select(-2, idx)
            layer.values[..., start:start + m, :] = layer.values.index_select(-2, idx)
            layer.keys = layer.keys[..., : start + m, :]
            layer.values = layer.values[..., : start + m, :]
