"""One target forward over several sequences at once, each with its own cache and mask.

The rows of all sequences go through every matrix product together (the weights are read once
for the whole batch); attention runs per sequence, each segment of rows against its own
``StaticCache`` (of its own length) with its own additive mask (a draft tree's ancestors).
The arithmetic is ``LeanDecoder``'s (``eagle.runtime.decoder``), on its weights: where one
sequence alone takes the compiled decoder stack (the compiled kernels run; ``runs_stack``), its segment takes the same compiled rotary, cache write and attention
(``rope_cache``, ``attention``), so each of its rows gets the bits it gets alone; else torch's.
A Gemma-3 target (``GemmaDecoder``) runs the sequences ``runs_stack`` takes in one call of its compiled stack
(``GemmaDecoder.segment_forward``, the same bits as alone) and each longer one by its own forward.

Caches that are slots of one ``CachePool`` (``kv_cache``; how a GPU batch keeps them) take one
attention call per layer for all sequences instead (``eagle.runtime.pooled.pooled_forward``)."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.nn.functional as F

from eagle.runtime.masks import causal_bias
from eagle.runtime.decoder import LeanDecoder
from eagle.runtime.gemma import GemmaDecoder
from eagle.runtime.kernels import runs_stack
from eagle.runtime.kv_cache import SlotCache, StaticCache
from eagle.runtime.layers import rotated, with_aux
from eagle.runtime.pooled import pooled_forward


def runs_segments(lean: object, pooled: bool = False) -> bool:
    """Whether ``segment_forward`` runs several sequences of this lean forward in one forward (``pooled``:
    with caches from one ``CachePool``)."""
    if pooled:
        return isinstance(lean, (LeanDecoder, GemmaDecoder))
    return isinstance(lean, LeanDecoder) or isinstance(lean, GemmaDecoder) and lean.stack is not None


def compiled_segments(lean: LeanDecoder, sizes: Sequence[int], masks: Sequence[torch.Tensor | None]) -> list[bool]:
    """Which segments of ``sizes`` rows take the compiled attention: those one sequence alone
    would run through the compiled decoder stack (``LeanDecoder.forward``)."""
    return [lean.stack is not None and runs_stack(n, m is not None) for n, m in zip(sizes, masks)]


@torch.inference_mode()
def segment_forward(lean: LeanDecoder | GemmaDecoder, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    caches: Sequence[StaticCache], sizes: Sequence[int], masks: Sequence[torch.Tensor | None],
                    aux_layers: Sequence[int] = ()) -> torch.Tensor:
    """``input_ids``/``position_ids`` [R]: the rows of S sequences one after another, ``sizes`` [S]
    rows each (sum R); sequence s's rows are appended to ``caches[s]`` and attend to it under
    ``masks[s]`` (additive [1, 1, n_s, past_s + n_s], or None: causal; with pooled caches each sequence
    sees its whole cache and only the masks' last n_s columns are read). Returns the final-norm
    hidden states [R, H] followed by the outputs of layers ``aux_layers`` ([R, (1 + n) H])."""
    if isinstance(caches[0], SlotCache):
        return pooled_forward(lean, input_ids, position_ids, caches, sizes, masks, aux_layers)
    if isinstance(lean, GemmaDecoder):
        return _gemma_segments(lean, input_ids, position_ids, caches, sizes, masks, aux_layers)
    nh, nkv, d = lean.num_heads, lean.num_kv_heads, lean.head_dim
    x = lean.embed(input_ids)  # [R, H]
    cos, sin = lean.rotary(x[None], position_ids[None])
    cos, sin = cos[0], sin[0]  # [R, d]
    compiled, scale = lean.compiled, d ** -0.5
    segments = []  # per sequence: (compiled, rows, its keys and values per layer or its cache, past, mask, cos, sin)
    start = 0
    for cache, n, mask, fast in zip(caches, sizes, masks, compiled_segments(lean, sizes, masks)):
        rows = slice(start, start + n)
        start += n
        if fast:  # the kernels write every layer's keys: their rows are reserved once
            past = cache.reserve_layers(cos.new_empty(1, nkv, n, d))
            buffers = [(k[0], v[0]) for k, v in zip(cache.keys, cache.values)]  # [kv, capacity, d] each
            segments.append((True, rows, buffers, past, None if mask is None else mask[0, 0].contiguous(),
                             cos[rows], sin[rows]))  # mask None: causal
        else:
            past = cache.get_seq_length()
            mask = mask if mask is not None or n == 1 else causal_bias(n, past, x.dtype, x.device)
            segments.append((False, rows, cache, past, mask, cos[None, None, rows], sin[None, None, rows]))

    def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:  # qkv [1, R, (nh + 2 nkv) d], before RoPE
        outs = []
        for fast, rows, held, past, mask, c, s in segments:
            if fast:  # the compiled rotary, cache write and attention
                keys, values = held[i]
                q = compiled.rope_cache(qkv[0, rows], c, s, keys, values, nh, past)
                outs.append(compiled.attention(q, keys, values, past + c.shape[0], mask, scale))  # [n, nh d]
                continue

            def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, held=held, mask=mask) -> torch.Tensor:
                keys, values = held.update(i, k, v)
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=nkv != nh,
                                                     scale=scale)  # [1, nh, n, d]
                return out[0].transpose(0, 1).reshape(-1, nh * d)

            outs.append(rotated(core, c, s, nh, nkv, d)(qkv[:, rows]))
        return (torch.cat(outs) if len(outs) > 1 else outs[0])[None]

    return with_aux(lean, x[None], None, attend, aux_layers)[0]


def _gemma_segments(lean: GemmaDecoder, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    caches: Sequence[StaticCache], sizes: Sequence[int], masks: Sequence[torch.Tensor | None],
                    aux_layers: Sequence[int]) -> torch.Tensor:
    """``segment_forward`` for a Gemma-3 target: the sequences ``runs_stack`` takes together in one call of the
    compiled stack, each other one by its own ``forward`` (as it runs alone)."""
    parts = [(slice(end - n, end), cache, n, mask)
             for end, cache, n, mask in zip(itertools.accumulate(sizes), caches, sizes, masks)]
    short = [p for p in parts if runs_stack(p[2], p[3] is not None)]
    out: dict[int, torch.Tensor] = {}
    if short:
        rows = torch.cat([torch.arange(r.start, r.stop) for r, *_ in short]).to(input_ids.device)
        together = lean.segment_forward(input_ids[rows], position_ids[rows], [p[1] for p in short],
                                        [p[2] for p in short], [p[3] for p in short], aux_layers)
        out.update(zip((r.start for r, *_ in short), together.split([p[2] for p in short])))
    for rows, cache, n, mask in parts:
        if not runs_stack(n, mask is not None):
            out[rows.start] = lean.forward(input_ids[None, rows], position_ids[None, rows], cache, mask, aux_layers)[0]
    return torch.cat([out[r.start] for r, *_ in parts])
