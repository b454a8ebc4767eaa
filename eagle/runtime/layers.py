"""One decoder-layer body per architecture, with the attention passed in.

``llama_layer`` (Llama, Qwen2, Qwen3, and the EAGLE drafters' layers) and ``gemma_layer`` (Gemma-3) do a
layer's arithmetic around its attention: norm, fused q/k/v, per-head norms, ``attend``, output product,
residual, gated MLP. ``attend(qkv)`` receives the heads [B, q, (heads + 2 kv_heads) d], before RoPE, and
returns the attention output [B, q, heads d]; each cache layout (one sequence's ``StaticCache``, a static
graph cache, slots of a ``CachePool``, rows of a batched cache) supplies it, usually as ``rotated(core)``:
q and k rotated, then ``core(q, k, v)`` stores the keys and values where that layout keeps them and
attends. ``each_layer`` runs a lean forward's layers (``LeanDecoder``, ``GemmaDecoder``: their
``layer_body``, ``rope_key``) over any layout; eager and static (captured) paths call the same bodies."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) rotated -> [B, q, heads d]
Attend = Callable[[torch.Tensor], torch.Tensor]  # qkv [B, q, (heads + 2 kv_heads) d] -> [B, q, heads d]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalize in fp32, scale in the input dtype. [..., H] -> [..., H]."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # same values (a compiled one: eagle.runtime.kernels)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: [..., 2 I] (gate, then up) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gemma_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalize and multiply by ``scale`` (= 1 + w, fp32) in fp32, then cast to
    the input dtype. [..., D] -> [..., D]."""
    return (F.rms_norm(x.float(), scale.shape, None, eps) * scale).to(x.dtype)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP activation: [..., 2 I] (gate, then up) -> gelu_tanh(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half layout. x [B, heads, q, d]; cos/sin broadcasting to [B, 1, q, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotated(core: Core, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int, d: int) -> Attend:
    """An ``attend`` that splits the heads, rotates queries and keys together (cos/sin broadcasting to
    [B, 1, q, d]) and hands q [B, nh, q, d], k and v [B, nkv, q, d] to ``core``."""
    def attend(qkv: torch.Tensor) -> torch.Tensor:
        b, q_len = qkv.shape[:2]
        qk, v = qkv.view(b, q_len, nh + 2 * nkv, d).transpose(1, 2).split([nh + nkv, nkv], dim=1)
        q, k = rotate(qk, cos, sin).split([nh, nkv], dim=1)
        return core(q, k, v)
    return attend


def llama_layer(layer: Any, x: torch.Tensor, attend: Attend, nh: int, nkv: int, norm: Callable = rms_norm,
                act: Callable = silu_mul, embeds: torch.Tensor | None = None) -> torch.Tensor:
    """A Llama-family decoder layer (``eagle.runtime.decoder.LayerWeights``) over x [B, q, H] -> x after it.
    ``norm``/``act``: RMSNorm and gated activation (torch's or the compiled ones: the same values);
    ``embeds`` [B, q, H]: the token embeddings an EAGLE-3 drafter layer's attention also reads."""
    qkv = layer.normed_heads(layer.qkv(layer.attention_input(x, embeds, norm)), nh, nkv, norm)
    x = x + layer.o(attend(qkv))
    return x + layer.down(act(layer.gate_up(norm(x, layer.post_norm, layer.post_eps))))


def gemma_layer(layer: Any, x: torch.Tensor, attend: Attend, nh: int, nkv: int, eps: float) -> torch.Tensor:
    """A Gemma-3 decoder layer (``eagle.runtime.gemma.GemmaLayer``) over x [B, q, H] -> x after it: (1 + w)
    RMSNorms before and after attention and the MLP, one on each query and key head, gelu-tanh MLP."""
    qkv = layer.qkv(gemma_norm(x, layer.input_norm, eps))
    q, k, v = qkv.unflatten(-1, (nh + 2 * nkv, layer.q_norm.numel())).split([nh, nkv, nkv], dim=-2)
    qkv = torch.cat([gemma_norm(q, layer.q_norm, eps), gemma_norm(k, layer.k_norm, eps), v], dim=-2).flatten(-2)
    x = x + gemma_norm(layer.o(attend(qkv)), layer.post_attention_norm, eps)
    h = layer.down(gelu_mul(layer.gate_up(gemma_norm(x, layer.pre_feedforward_norm, eps))))
    return x + gemma_norm(h, layer.post_feedforward_norm, eps)


def each_layer(lean: Any, x: torch.Tensor, rope: dict | None,
               attend: Callable[..., torch.Tensor]) -> Iterator[torch.Tensor]:
    """x [B, q, H] after each of a lean forward's layers in turn, each a new tensor. ``rope``: the rotary
    tables of the rows, {``lean.rope_key(layer)``: (cos, sin) broadcasting to [B, 1, q, d]}, and
    ``attend(i, q, k, v)`` (rotated; ``rotated``) for layer i; or None and ``attend(i, qkv)`` (the heads
    before RoPE: a layout that rotates them itself)."""
    nh, nkv, d = lean.num_heads, lean.num_kv_heads, lean.head_dim
    for i, layer in enumerate(lean.layers):
        step = functools.partial(attend, i)
        if rope is not None:
            step = rotated(step, *rope[lean.rope_key(layer)], nh, nkv, d)
        x = lean.layer_body(layer, x, step)
        yield x


def run_layers(lean: Any, x: torch.Tensor, rope: dict | None, attend: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``each_layer``'s last x: [B, q, H] after every layer, before the final norm."""
    for x in each_layer(lean, x, rope, attend):
        pass
    return x


def with_aux(lean: Any, x: torch.Tensor, rope: dict | None, attend: Callable[..., torch.Tensor],
             aux_layers: tuple | list = ()) -> torch.Tensor:
    """The final-norm features of x after every layer followed along the last dim by the outputs of layers
    ``aux_layers``: [..., (1 + n) H]."""
    kept: dict[int, torch.Tensor] = {}
    for i, x in enumerate(each_layer(lean, x, rope, attend)):
        if i in aux_layers:
            kept[i] = x
    return torch.cat([lean.final_norm(x)] + [kept[i] for i in aux_layers], dim=-1)
