"""Batched rows: a KV cache [2, layers, rows, capacity, kv_heads, head_dim] in which each row is one
sequence at its own length, and the lean forward's layers over it (``eagle.runtime.layers``, this layout's
attention): ``decode_rows`` (one token a row, capturable), ``prefill_rows`` (prompts into rows) and
``extend_rows`` (prompt tails after a row's cached head). Rows attend to their own positions only
(within a sliding layer's window), so a row decodes as it would alone up to floating-point rounding.
Used by batched plain decoding (``train.generation``) and the pooled forwards (``eagle.runtime.pooled``:
``LayerPlan``, ``rotary_tables``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from eagle.runtime.masks import additive_bias
from eagle.runtime.gemma import GemmaDecoder
from eagle.runtime.layers import run_layers

ATTENTION = ("auto", "sdpa", "varlen")  # a batched step's attention: ``varlen`` where ``varlen_works``


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What batched attention needs to know of a lean forward's layers: each layer's attention window
    (None: full attention) and the attention scale (Llama family: head_dim^-0.5; Gemma-3: its own)."""

    windows: tuple[int | None, ...]
    scale: float

    @staticmethod
    def of(lean: Any) -> "LayerPlan":
        if isinstance(lean, GemmaDecoder):
            return LayerPlan(tuple(layer.window for layer in lean.layers), lean.scale)
        return LayerPlan((None,) * len(lean.layers), lean.head_dim ** -0.5)


Rope = dict  # a rotary table's key -> (cos, sin): [C, d] per position, or gathered for a call's positions


def rotary_tables(lean: Any, capacity: int, device: torch.device, dtype: torch.dtype) -> Rope:
    """cos/sin [C, d] for positions 0 .. C-1 of every rotary table the layers use (Gemma-3: one per
    layer type, local and global)."""
    x, positions = torch.zeros(1, dtype=dtype, device=device), torch.arange(capacity, device=device)[None]
    if isinstance(lean, GemmaDecoder):
        return {t: tuple(c[0] for c in lean.rotary(x, positions, t)) for t in lean.layer_types}
    return {None: tuple(c[0] for c in lean.rotary(x, positions))}


def gathered(rope: Rope, positions: torch.Tensor, shape: Sequence[int]) -> Rope:
    """``rope``'s tables at ``positions`` (any shape), viewed as ``shape`` + [d] (broadcasting to [n,
    1, m, d])."""
    return {key: tuple(t[positions].reshape(*shape, t.shape[-1]) for t in tables) for key, tables in rope.items()}


def allowed_keys(keys: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which cache positions ``keys`` a query at ``positions`` sees (itself and before, within
    ``window`` of it when given): broadcasts keys against positions."""
    allowed = keys <= positions
    return allowed if window is None else allowed & (keys > positions - window)


def masks_by_window(plan: LayerPlan, keys: torch.Tensor, positions: torch.Tensor,
                    dtype: torch.dtype) -> dict[int | None, torch.Tensor]:
    """The additive attention mask (``allowed_keys``, ``additive_bias``) of each window the layers use."""
    return {w: additive_bias(allowed_keys(keys, positions, w), dtype) for w in set(plan.windows)}


def decode_rows(lean: Any, kv: torch.Tensor, rope: Rope, ids: torch.Tensor, positions: torch.Tensor,
                keys_len: int, varlen: bool = False) -> torch.Tensor:
    """One decode step of R rows, every shape fixed and every index on the device (capturable):
    ``kv`` [2, layers, R, C, kv_heads, d] (row r's keys at its positions), ``rope`` the rotary
    tables [C, d] (``rotary_tables``), ``ids``/``positions`` [R] each row's token and where it goes.
    Row r attends to its positions 0 .. positions[r] (within a sliding layer's window): among the
    first ``keys_len`` (``sdpa``), or exactly those (``varlen``: ``varlen_attention``; full attention
    only). -> final-norm features [R, H]."""
    r = ids.shape[0]
    nh, nkv, d = lean.num_heads, lean.num_kv_heads, lean.head_dim
    plan = LayerPlan.of(lean)
    x = lean.embed(ids)[:, None]  # [R, 1, H]
    if varlen:
        used = (positions + 1).to(torch.int32)
    else:
        masks = masks_by_window(plan, torch.arange(keys_len, device=ids.device)[None, None, None],
                                positions[:, None, None, None], x.dtype)  # [R, 1, 1, Lk] each
    write = positions[:, None, None, None].expand(r, 1, nkv, d)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # q [R, heads, 1, d]
        keys, values = kv[0, i], kv[1, i]  # [R, C, kv_heads, d]
        keys.scatter_(1, write, k.transpose(1, 2))
        values.scatter_(1, write, v.transpose(1, 2))
        if varlen:
            out = varlen_attention(q[:, :, 0].contiguous(), keys, values, used, plan.scale)  # [R, heads, d]
        else:
            # the query heads sharing a key head as rows of one head (grouped-query attention)
            out = F.scaled_dot_product_attention(q.reshape(r, nkv, nh // nkv, d),
                                                 keys[:, :keys_len].transpose(1, 2),
                                                 values[:, :keys_len].transpose(1, 2),
                                                 attn_mask=masks[plan.windows[i]], scale=plan.scale)
        return out.reshape(r, 1, nh * d)

    return lean.final_norm(run_layers(lean, x, gathered(rope, positions, (r, 1, 1)), attend))[:, 0]


def varlen_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, used: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per row over that row's first ``used`` [R] (int32) cache positions: ``q`` [R, heads,
    d], ``keys``/``values`` [R, C, kv_heads, d] (contiguous rows) -> [R, heads, d]. Flash attention's
    variable-length form (row r's keys start at r * C, ``seqused_k`` of them count): nothing past a
    row's length is read. Capturable; CUDA, bf16/fp16 only."""
    r, c, nkv, d = keys.shape
    starts = torch.arange(r + 1, dtype=torch.int32, device=q.device)
    return flash_varlen(q, keys.reshape(r * c, nkv, d), values.reshape(r * c, nkv, d), starts, starts * c, 1, c,
                        0.0, False, False, scale=scale, seqused_k=used)[0]


def flash_varlen(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """torch's flash attention over packed variable-length rows (``aten._flash_attention_forward``)."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def varlen_works(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when ``varlen_attention`` runs here and matches plain attention on random rows of
    several lengths, else why not (a CPU, fp32, an old torch, a wrong result)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return f"varlen attention needs CUDA in bf16/fp16, not {device.type} {dtype}"
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        r, c, nh, nkv, d = 5, 96, 6, 2, 64
        q = torch.randn(r, nh, d, device=device, dtype=dtype, generator=gen)
        keys, values = (torch.randn(r, c, nkv, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
        used = torch.tensor([1, 7, 64, 90, 96], dtype=torch.int32, device=device)
        out = varlen_attention(q, keys, values, used, d ** -0.5).float()
        for row in range(r):
            n = int(used[row])
            k = keys[row, :n].float().repeat_interleave(nh // nkv, dim=1)  # [n, nh, d]
            v = values[row, :n].float().repeat_interleave(nh // nkv, dim=1)
            weights = torch.softmax(torch.einsum("hd,nhd->hn", q[row].float(), k) * d ** -0.5, -1)
            want = torch.einsum("hn,nhd->hd", weights, v)
            if not torch.allclose(out[row], want, atol=2e-2, rtol=2e-2):
                return f"varlen attention differs from plain attention (row {row}, {n} keys)"
    except Exception as exc:  # noqa: BLE001 - any failure means: use sdpa
        return f"varlen attention failed: {type(exc).__name__}: {exc}"
    return None


def prefill_rows(lean: Any, kv: torch.Tensor, rope: Rope, slots: torch.Tensor, ids: torch.Tensor,
                 last: torch.Tensor) -> torch.Tensor:
    """Prompts ``ids`` [n, P] (right-padded) into cache rows ``slots`` [n] of ``kv`` [2, layers, R, C,
    kv_heads, d] at positions 0 .. P-1 (a padded position's keys are overwritten before any step
    attends to them); -> final-norm features of each row's token ``last`` [n] (its last real one) [n, H]."""
    n, p = ids.shape
    nh, nkv, d = lean.num_heads, lean.num_kv_heads, lean.head_dim
    plan = LayerPlan.of(lean)
    x = lean.embed(ids)
    span = torch.arange(p, device=ids.device)
    # causal attention within each layer's window: a mask only where a window is shorter than the prompt
    masks = {w: None if w is None or w >= p else additive_bias(allowed_keys(span[None], span[:, None], w), x.dtype)
             for w in set(plan.windows)}  # [1, 1, P, P]

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv[0, i, slots, :p] = k.transpose(1, 2)
        kv[1, i, slots, :p] = v.transpose(1, 2)
        mask = masks[plan.windows[i]]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=nkv != nh,
                                             scale=plan.scale)
        return out.transpose(1, 2).reshape(n, p, nh * d)

    x = run_layers(lean, x, gathered(rope, span, (1, 1, p)), attend)
    return lean.final_norm(x[torch.arange(n, device=ids.device), last])


def extend_rows(lean: Any, kv: torch.Tensor, rope: Rope, slots: torch.Tensor, ids: torch.Tensor,
                starts: torch.Tensor, last: torch.Tensor, keys_len: int) -> torch.Tensor:
    """Prompt tails ``ids`` [n, M] (right-padded) into cache rows ``slots`` [n] of ``kv`` [2, layers, R,
    C, kv_heads, d] at positions starts[i] .. starts[i] + M - 1, the row's positions below starts[i]
    already holding the prompt's head: each tail token attends to its row's cache up to itself
    (within a sliding layer's window; ``keys_len`` >= max(starts) + M, at most C, positions past C - 1
    are written there: padding only). -> final-norm features of each row's tail token ``last`` [n]
    (its prompt's last) [n, H]."""
    n, m = ids.shape
    nh, nkv, d = lean.num_heads, lean.num_kv_heads, lean.head_dim
    plan = LayerPlan.of(lean)
    pos = (starts[:, None] + torch.arange(m, device=ids.device)[None]).clamp(max=kv.shape[3] - 1)  # [n, M]
    x = lean.embed(ids)
    masks = masks_by_window(plan, torch.arange(keys_len, device=ids.device)[None, None, None],
                            pos[:, None, :, None], x.dtype)  # [n, 1, M, Lk] each
    rows = slots[:, None]

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # q [n, heads, M, d]
        kv[0, i][rows, pos] = k.transpose(1, 2)
        kv[1, i][rows, pos] = v.transpose(1, 2)
        keys, values = (kv[j, i][slots, :keys_len].transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
                        for j in (0, 1))  # [n, heads, Lk, d]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[plan.windows[i]], scale=plan.scale)
        return out.transpose(1, 2).reshape(n, m, nh * d)

    x = run_layers(lean, x, gathered(rope, pos, (n, 1, m)), attend)
    return lean.final_norm(x[torch.arange(n, device=ids.device), last])
