"""One target forward over several sequences at once, each with its own cache and mask.

The rows of all sequences go through every matrix product together (the weights are read once
for the whole batch); attention runs per sequence, each segment of rows against its own
``StaticCache`` (of its own length) with its own additive mask (a draft tree's ancestors).
The arithmetic is ``LeanDecoder``'s (``eagle.runtime.decoder``), on its weights."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from eagle.decoding.tree_mask import causal_bias
from eagle.runtime.decoder import LeanDecoder, rotate
from eagle.runtime.kv_cache import StaticCache


@torch.inference_mode()
def segment_forward(lean: LeanDecoder, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    caches: Sequence[StaticCache], sizes: Sequence[int], masks: Sequence[torch.Tensor | None],
                    aux_layers: Sequence[int] = ()) -> torch.Tensor:
    """``input_ids``/``position_ids`` [R]: the rows of S sequences one after another, ``sizes`` [S]
    rows each (sum R); sequence s's rows are appended to ``caches[s]`` and attend to it under
    ``masks[s]`` (additive [1, 1, n_s, past_s + n_s], or None: causal). Returns the final-norm
    hidden states [R, H] followed by the outputs of layers ``aux_layers`` ([R, (1 + n) H])."""
    nh, nkv, d = lean.num_heads, lean.num_kv_heads, lean.head_dim
    rows = input_ids.shape[0]
    x = lean.embed(input_ids[None])  # [1, R, H]
    cos, sin = lean.rotary(x, position_ids[None])
    cos, sin = cos[:, None], sin[:, None]  # [1, 1, R, d]
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    masks = [m if m is not None or n == 1 else causal_bias(n, c.get_seq_length(), x.dtype, x.device)
             for m, n, c in zip(masks, sizes, caches)]
    kept: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(lean.layers):
        qkv = layer.qkv(lean.rms_norm(x, layer.input_norm, layer.input_eps))
        qk, v = qkv.view(1, rows, nh + 2 * nkv, d).transpose(1, 2).split([nh + nkv, nkv], dim=1)
        q, k = rotate(qk, cos, sin).split([nh, nkv], dim=1)  # [1, heads, R, d]
        outs = []
        for cache, start, n, mask in zip(caches, starts, sizes, masks):
            keys, values = cache.update(i, k[:, :, start:start + n], v[:, :, start:start + n])
            outs.append(F.scaled_dot_product_attention(q[:, :, start:start + n], keys, values, attn_mask=mask,
                                                       enable_gqa=nkv != nh, scale=d ** -0.5))
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        x = x + layer.o(out.transpose(1, 2).reshape(1, rows, nh * d))
        x = x + layer.down(lean.silu_mul(layer.gate_up(lean.rms_norm(x, layer.post_norm, layer.post_eps))))
        if i in aux_layers:
            kept[i] = x
    return torch.cat([lean.rms_norm(x, lean.norm, lean.norm_eps)] + [kept[i] for i in aux_layers], dim=-1)[0]
