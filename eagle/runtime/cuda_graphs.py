"""Static-shape forwards of the target and the drafter, replayed as CUDA graphs.

On a GPU a small model's forward is bound by kernel launches, not arithmetic: hundreds of small
kernels each cost a launch. Here each forward runs on fixed shapes so that it can be captured once
in a ``torch.cuda.CUDAGraph`` and replayed with one launch:

- ``GraphCache``: keys and values of every layer in one preallocated buffer
  [2, layers, 1, kv_heads, capacity, head_dim] (capacity fixed at creation), written by position
  (``index_copy_``) and compacted by one gather (``compact``);
- a call of n tokens is padded to the smallest bucket B >= n (``BUCKETS``); it attends over the
  first Lk cache positions (Lk a power of two >= ``shapes.MIN_KEYS``, or the capacity), with static input buffers
  for token ids (or features and embeddings for the drafter), positions, the additive mask
  [1, 1, B, Lk] and the cache write positions [B]; the output lives in a static buffer. Padded
  rows write their keys and values at positions past the n real ones, which no real row attends to
  and which a later call overwrites; each padded row attends causally, so every value stays finite;
- each (bucket, Lk, ...) shape is captured on first use, after warm-up runs on a side stream.

A shape whose capture fails runs eagerly from then on (one warning per distinct error) and is
counted: ``capture_stats`` says how many shapes were captured and how many fell back, process-wide;
the tests, ``eagle-bench`` and ``scripts/gpu_check.sh`` treat a fallback as a failure. The capture
itself is ``cuda_capture``; ``capture_with`` installs another (``eagle.runtime.fake_capture``: a CPU
stand-in that refuses what CUDA capture refuses; ``EAGLE_FAKE_CAPTURE=1`` uses it on a CPU).

With ``capture=False`` (and always on a CPU) the same buffers and the same function run eagerly,
without graphs: the graph-free path the tests compare with the plain forward. Calls of more than
``BUCKETS[-1]`` tokens (a prefill) run eagerly at their own size. One runner owns one cache:
``new_cache`` hands out that cache, emptied."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from eagle.errors import EagleError
from eagle.runtime.kv_cache import StaticCache
from eagle.runtime.decoder import LayerWeights
from eagle.runtime.layers import llama_layer, rms_norm, rotated
from eagle.runtime.shapes import (BUCKETS, MIN_KEYS, StaticRunner, StaticShape, bucket_for, capture_graph,  # noqa: F401
                                  capture_stats, capture_with, capturer_for, cuda_capture, keys_for)

class GraphCache(StaticCache):
    """A ``StaticCache`` whose buffers are views of one preallocated tensor ``kv``
    [2, layers, 1, kv_heads, capacity, head_dim] that never moves (graphs hold its address)."""

    gathers = True  # ``eagle.runtime.kv_cache.compact`` hands every compaction to ``compact`` (no check on the host)

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(num_layers)
        self.capacity = capacity
        self.kv = torch.zeros(2, num_layers, 1, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.keys, self.values = list(self.kv[0].unbind(0)), list(self.kv[1].unbind(0))

    def reserve(self, index: int, like: torch.Tensor) -> int:
        start = self.lengths[index]
        if start + like.shape[-2] > self.capacity:
            raise EagleError(f"the static KV cache holds {self.capacity} positions; {start + like.shape[-2]} needed")
        self.lengths[index] = start + like.shape[-2]
        return start

    def keep_rows(self, rows: torch.Tensor) -> None:
        raise EagleError("the static KV cache holds one sequence")

    def set_length(self, length: int) -> None:
        self.lengths = [length] * len(self.lengths)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move positions ``keep`` [m] (increasing, >= start) to start .. start + m - 1 in every
        layer at once (one gather, one copy, on the device)."""
        m = keep.shape[0]
        self.kv[..., start:start + m, :] = self.kv.index_select(-2, keep.to(self.kv.device))
        self.truncate(start + m)


def layer_stack(layers: Sequence[LayerWeights], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: torch.Tensor, write: torch.Tensor, mask: torch.Tensor, num_heads: int, num_kv_heads: int,
                head_dim: int, aux_layers: Sequence[int] = (),
                embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Llama decoder layers on static shapes: x [1, B, H]; cos/sin [1, 1, B, d]; ``kv`` the cache
    [2, layers, 1, kv_heads, capacity, d]; ``write`` [B] the positions the new keys/values go to;
    ``mask`` additive [1, 1, B, Lk] over the first Lk positions. Returns x after the layers and the
    outputs of ``aux_layers``. ``embeds`` [1, B, H]: the token embeddings an EAGLE-3 drafter layer's
    attention reads too (``LayerWeights.attention_input``). The arithmetic of
    ``eagle.runtime.layers.llama_layer`` (torch's RMSNorm and activation: what a capture records)."""
    b, q_len = x.shape[:2]
    nh, nkv, d = num_heads, num_kv_heads, head_dim
    keys_len, group = mask.shape[-1], nh // nkv
    # grouped-query attention as plain attention: the query heads sharing a key head become rows of one
    # head ([1, nkv, group * q, d]), the mask tiled to match; one fused kernel where ``enable_gqa`` may not be
    rows_mask = mask.repeat(1, 1, group, 1) if group > 1 else mask
    kept = []
    for i, layer in enumerate(layers):
        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int = i) -> torch.Tensor:
            keys, values = kv[0, i], kv[1, i]
            keys.index_copy_(2, write, k)
            values.index_copy_(2, write, v)
            out = F.scaled_dot_product_attention(q.reshape(b, nkv, group * q_len, d), keys[:, :, :keys_len],
                                                 values[:, :, :keys_len], attn_mask=rows_mask, scale=d ** -0.5)
            return out.reshape(b, nh, q_len, d).transpose(1, 2).reshape(b, q_len, nh * d)

        x = llama_layer(layer, x, rotated(core, cos, sin, nh, nkv, d), nh, nkv, embeds=embeds)
        if i in aux_layers:
            kept.append(x)
    return x, kept


class _Runner(StaticRunner):
    """What the target's and the drafter's runners share: the cache, the buckets, the mask
    filling; capture and replay are ``StaticRunner``'s."""

    def __init__(self, cache: GraphCache, dtype: torch.dtype, device: torch.device, capture: bool,
                 buckets: Sequence[int]) -> None:
        super().__init__(device, capture)
        self.cache, self.dtype = cache, dtype
        self.buckets = tuple(buckets)
        self.min_value = torch.finfo(dtype).min
        top = self.buckets[-1]
        # [top, top] additive causal triangle; the cache positions as a device vector
        self.triangle = torch.full((top, top), self.min_value, dtype=dtype, device=device).triu(1)
        self.positions = torch.arange(cache.capacity + top, device=device)

    def new_cache(self) -> GraphCache:
        self.cache.set_length(0)
        return self.cache

    def _fill_mask(self, mask: torch.Tensor, past: int, n: int, attention_mask: torch.Tensor | None) -> None:
        """``mask`` [1, 1, B, Lk]: every row sees the prefix; the B new positions causally
        (padded rows too); nothing later; then the real rows' given mask [1, 1, n, past + n]."""
        size = mask.shape[-2]
        m = mask[0, 0]
        m[:, :past] = 0
        if size <= self.triangle.shape[0]:
            m[:, past:past + size] = self.triangle[:size, :size]
        else:
            m[:, past:past + size] = torch.full((size, size), self.min_value, dtype=self.dtype,
                                                device=self.device).triu(1)
        m[:, past + size:] = self.min_value
        if attention_mask is not None:
            m[:n, :past + n] = attention_mask[0, 0]

    def _call(self, key: tuple, size: int, keys_len: int, make: Callable[[int, int], StaticShape],
              fill: Callable[[StaticShape], None]) -> torch.Tensor:
        """Fill the inputs of shape ``key`` (made on first use) and run it: replay its graph, or run it eagerly."""
        if size not in self.buckets:  # a prefill: eager, at its own size
            entry = make(size, keys_len)
            fill(entry)
            return entry.run()
        return self.run(key, lambda: make(size, keys_len), fill)

    def _shape(self, n: int) -> tuple[int, int, int]:
        """(past, bucket or n, attended length) for a call of n tokens."""
        past = self.cache.get_seq_length()
        size = bucket_for(n, self.buckets) or n
        if past + size > self.cache.capacity:
            raise EagleError(f"the static KV cache holds {self.cache.capacity} positions; {past + size} needed")
        return past, size, keys_for(past + size, self.cache.capacity)

    def _common(self, entry: StaticShape, past: int, n: int, positions: torch.Tensor,
                attention_mask: torch.Tensor | None) -> None:
        size = entry.inputs["write"].shape[0]
        entry.inputs["pos"][:, :n].copy_(positions)
        entry.inputs["write"].copy_(self.positions[past:past + size])
        self._fill_mask(entry.inputs["mask"], past, n, attention_mask)


class TargetGraphs(_Runner):
    """The target's forward (``eagle.runtime.decoder.LeanDecoder``'s weights) on static shapes, with its own
    ``GraphCache`` of ``capacity`` positions (default: the model's context plus the largest
    bucket). ``forward`` is ``LeanDecoder.forward`` for one sequence."""

    def __init__(self, lean: Any, capacity: int, capture: bool = True, buckets: Sequence[int] = BUCKETS) -> None:
        weight = lean.head.weight
        device, dtype = weight.device, weight.dtype
        capacity = -(-(capacity + buckets[-1]) // 16) * 16  # room for padded rows; aligned rows for the kernels
        super().__init__(GraphCache(len(lean.layers), lean.num_kv_heads, lean.head_dim, capacity, dtype, device),
                         dtype, device, capture, buckets)
        self.lean = lean
        with torch.inference_mode():
            cos, sin = lean.rotary(torch.zeros(1, dtype=dtype, device=device), self.positions[None, :capacity])
        self.cos, self.sin = cos[0], sin[0]  # [capacity, d]
        self._step_inputs: dict[str, torch.Tensor] | None = None  # ``greedy_step``'s, shared by its shapes

    def curve_sizes(self) -> tuple[int, ...]:
        """Tree sizes for a cost curve (``eagle.decoding.tree_sizing``): each bucket and the size just past it."""
        return tuple(sorted({1, *self.buckets, *(b + 1 for b in self.buckets[:-1])}))

    def describe(self) -> str:
        return f"cuda graphs {list(self.buckets)}" if self.capture else f"static buckets {list(self.buckets)}"

    def _make(self, size: int, keys_len: int, aux_layers: tuple[int, ...]) -> StaticShape:
        dev = self.device
        inputs = dict(ids=torch.zeros(1, size, dtype=torch.long, device=dev),
                      pos=torch.zeros(1, size, dtype=torch.long, device=dev),
                      write=torch.zeros(size, dtype=torch.long, device=dev),
                      mask=torch.zeros(1, 1, size, keys_len, dtype=self.dtype, device=dev))
        lean = self.lean

        def run() -> torch.Tensor:
            x = lean.embed(inputs["ids"])
            pos = inputs["pos"][0]
            x, aux = layer_stack(lean.layers, x, self.cos[pos][None, None], self.sin[pos][None, None], self.cache.kv,
                                 inputs["write"], inputs["mask"], lean.num_heads, lean.num_kv_heads, lean.head_dim,
                                 aux_layers)
            return torch.cat([rms_norm(x, lean.norm, lean.norm_eps)] + aux, dim=-1)

        return StaticShape(inputs, run)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: GraphCache,
                attention_mask: torch.Tensor | None = None, aux_layers: Sequence[int] = ()) -> torch.Tensor:
        """``input_ids``/``position_ids`` [1, n]; ``attention_mask`` additive [1, 1, n, past + n] or
        None (causal) -> [1, n, (1 + len(aux_layers)) H] (a copy); the cache grows by n."""
        if cache is not self.cache:
            raise EagleError("this cache belongs to another runner: use Target.new_cache()")
        n = input_ids.shape[1]
        past, size, keys_len = self._shape(n)
        aux = tuple(aux_layers)

        def fill(entry: StaticShape) -> None:
            entry.inputs["ids"][:, :n].copy_(input_ids)
            self._common(entry, past, n, position_ids, attention_mask)

        out = self._call(("target", size, keys_len, aux), size, keys_len,
                         lambda s, k: self._make(s, k, aux), fill)
        cache.set_length(past + n)
        return out[:, :n].clone()


    def greedy_step(self, token: torch.Tensor, past: int) -> torch.Tensor:
        """One greedy decoding step as one static function (one graph on CUDA, one per attended
        length): ``token`` [1] (on the device) at position ``past`` (the cache's length) -> its keys
        and values written there and the target's greedy next token [1] (static memory, overwritten
        by the next step of the same attended length); the cache grows by one. The host writes two
        scalars and replays; the mask, positions and write index are computed on the device."""
        if past + 1 > self.cache.capacity:
            raise EagleError(f"the static KV cache holds {self.cache.capacity} positions; {past + 1} needed")
        keys_len = keys_for(past + 1, self.cache.capacity)
        if self._step_inputs is None:
            self._step_inputs = dict(token=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                                     past=torch.zeros((), dtype=torch.long, device=self.device))
        inputs, lean = self._step_inputs, self.lean

        def make() -> StaticShape:
            columns = self.positions[:keys_len]

            def run() -> torch.Tensor:
                past_ = inputs["past"]
                pos = past_[None]  # [1]
                mask = torch.zeros(keys_len, dtype=self.dtype, device=self.device).masked_fill(columns > past_,
                                                                                           self.min_value)
                x, _ = layer_stack(lean.layers, lean.embed(inputs["token"]), self.cos[pos][None, None],
                                   self.sin[pos][None, None], self.cache.kv, pos, mask[None, None, None],
                                   lean.num_heads, lean.num_kv_heads, lean.head_dim)
                # torch's argmax (a capture records torch's operations; a GPU's head has no greedy screen)
                return lean.head(rms_norm(x, lean.norm, lean.norm_eps)[0]).argmax(-1)

            return StaticShape(inputs, run)

        def fill(entry: StaticShape) -> None:
            inputs["token"].copy_(token.reshape(1, 1))
            inputs["past"].fill_(past)

        out = self.run(("greedy step", keys_len), make, fill)
        self.cache.set_length(past + 1)
        return out


class GraphedDrafter:
    """A ``LeanDrafter`` whose calls on its own cache (``new_cache``) run on static shapes (graphs on
    CUDA); the rest of its interface is passed through. ``capacity``: cache positions (committed
    tokens plus a round's drafted ones)."""

    def __init__(self, drafter: Any, capacity: int, capture: bool = True, buckets: Sequence[int] = BUCKETS) -> None:
        from eagle.drafting.drafter import fused_input, rotary_angles

        self.inner, self.config, self.dtype = drafter, drafter.config, drafter.dtype
        cfg = drafter.config
        device = drafter.device
        capacity = -(-(capacity + buckets[-1]) // 16) * 16
        self.runner = _Runner(GraphCache(cfg.num_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, self.dtype,
                                         device), self.dtype, device, capture, buckets)
        angles = rotary_angles(self.runner.positions[:capacity], cfg.head_dim, cfg.rope_theta)
        self.cos, self.sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        self._fused_input = fused_input

    def __getattr__(self, name: str) -> Any:  # draft_logits, to_target_ids, d2t, lm_head, ...
        return getattr(self.inner, name)

    def new_cache(self) -> GraphCache:
        return self.runner.new_cache()

    def _make(self, size: int, keys_len: int, width: int) -> StaticShape:
        dev, h = self.runner.device, self.config.hidden_size
        inputs = dict(features=torch.zeros(1, size, width, dtype=self.dtype, device=dev),
                      embeds=torch.zeros(1, size, h, dtype=self.dtype, device=dev),
                      pos=torch.zeros(1, size, dtype=torch.long, device=dev),
                      write=torch.zeros(size, dtype=torch.long, device=dev),
                      mask=torch.zeros(1, 1, size, keys_len, dtype=self.dtype, device=dev))

        def run() -> torch.Tensor:
            return self.step(inputs["features"], inputs["embeds"], inputs["pos"][0], inputs["write"], inputs["mask"])

        return StaticShape(inputs, run)

    def step(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, write: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
        """The drafter's layers on its cache, every shape fixed and every index on the device (to be
        captured inside a larger static function): ``features`` [1, B, F], ``embeds`` [1, B, H],
        ``positions`` [B], ``write`` [B] cache positions, ``mask`` additive [1, 1, B, Lk] -> [1, B, H]."""
        cfg = self.config
        x = self._fused_input(self.inner.fc, features, embeds, cfg)
        x, _ = layer_stack(self.inner.layers, x, self.cos[positions][None, None], self.sin[positions][None, None],
                           self.runner.cache.kv, write, mask, cfg.num_attention_heads, cfg.num_key_value_heads,
                           cfg.head_dim, embeds=embeds)
        return x

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                 cache: StaticCache | None = None, attention_bias: torch.Tensor | None = None) -> torch.Tensor:
        """As ``Drafter.forward`` for one sequence: [1, n, ...] -> predicted features [1, n, H] (a copy)."""
        if cache is not self.runner.cache:
            return self.inner(features, token_embeds, positions, cache, attention_bias)
        n, width = token_embeds.shape[1], features.shape[-1]
        past, size, keys_len = self.runner._shape(n)

        def fill(entry: StaticShape) -> None:
            entry.inputs["features"][:, :n].copy_(features)
            entry.inputs["embeds"][:, :n].copy_(token_embeds)
            self.runner._common(entry, past, n, positions, attention_bias)

        out = self.runner._call(("drafter", size, keys_len, width), size, keys_len,
                                lambda s, k: self._make(s, k, width), fill)
        cache.set_length(past + n)
        return out[:, :n].clone()


def with_graphs(target: Any, capture: bool = True, capacity: int | None = None,
                buckets: Sequence[int] = BUCKETS) -> Any:
    """A copy of ``target`` (an ``eagle.runtime.target.Target`` with a lean forward) that decodes through a
    ``TargetGraphs``: captured graphs on CUDA when ``capture``, else the same static path eagerly."""
    if target.lean is None:
        raise EagleError(f"{target.name} has no lean forward; the static decoding path needs one")
    runner = TargetGraphs(target.lean, capacity or target.max_context, capture, buckets)
    return dataclasses.replace(target, graphs=runner)
