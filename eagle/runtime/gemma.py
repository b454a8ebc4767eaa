"""A lean inference forward for Gemma-3 text targets, sliding-window layers included.

``GemmaDecoder`` does the arithmetic of transformers' Gemma-3 decoder with the interface of
``eagle.runtime.decoder.LeanDecoder`` (``forward``, ``new_cache``, ``head``, ``argmax``): (1 + w)
RMSNorms before and after attention and the MLP, RMSNorms on each head's queries and keys, the
embedding scaled by sqrt(hidden) (the model's own embedding module), RoPE from the model's rotary
module per layer type (local and global theta, rope scaling as configured), scores scaled by
``query_pre_attn_scalar ** -0.5``, a gelu-tanh gated MLP and the tied embedding as LM head.

Sliding-window layers keep every key in the ``StaticCache`` (so a rejected tree branch rolls back
as in any layer) and mask what lies outside the window instead: a query at position p sees keys at
positions p - window + 1 .. p, and in tree verification only those of them the tree mask allows
(the prefix and its ancestors). Full-attention layers take the mask as given. The products go through
``PackedLinear`` or, for a GGUF target, ``GGUFLinear`` (its codes); in fp32 on a CPU, one sequence of 1-16
rows (decoding, tree verification) runs every layer in one call of the compiled ``GemmaStack``, whose rows do
not depend on each other (``eagle.runtime.kernels``), so a tree node gets the bits of the plain step; the
rest (longer prefills) by torch's operations."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import dataclasses

import torch
import torch.nn.functional as F

from eagle.runtime.masks import causal_bias
from eagle.runtime.decoder import (HeadAndCache, PackedLinear, check_int8_activations, coded_weights, head_is_fp32_cpu,
                                   head_weight, int8_activations_here, lm_head, product, screened)
from eagle.runtime.gguf_weights import GGUFLinear
from eagle.runtime.layers import gelu_mul, gemma_layer, gemma_norm, with_aux  # noqa: F401 - re-exported
from eagle.runtime.kernels import attention_takes, cpu_kernels, runs_stack
from eagle.runtime.kv_cache import StaticCache

GEMMA_MODEL_TYPES = ("gemma3_text",)
SLIDING, FULL = "sliding_attention", "full_attention"


def norm_scale(norm: Any) -> torch.Tensor:
    """The fp32 factor a Gemma RMSNorm module applies after normalizing: 1 + its weight."""
    return 1.0 + norm.weight.detach().float()


def sliding_bias(bias: torch.Tensor | None, position_ids: torch.Tensor, past: int,
                 window: int) -> tuple[torch.Tensor | None, int]:
    """The mask of a sliding-window layer for a forward of q tokens after ``past`` cached ones, and
    the first cache slot it reads (slots before it are out of every query's window).
    ``bias``: the forward's additive mask [1 or B, 1, q, past + q] (None: causal); ``position_ids``
    [B, q]. A query at position p keeps the keys ``bias`` allows at positions > p - window. Cached
    slot j holds position j + position_ids[:, 0] - past (the first query continues the prefix, as
    in every forward eagle makes, a tree's root included). Returns (mask [1 or B, 1, q,
    past + q - start], or None where causal attention to every read slot is right; start)."""
    q_len = position_ids.shape[1]
    start = max(0, past - window + 1)
    if bias is None and q_len == 1:
        return None, start
    return window_bias(bias, position_ids, past, window, start), start


def window_bias(bias: torch.Tensor | None, position_ids: torch.Tensor, past: int, window: int,
                start: int = 0) -> torch.Tensor:
    """``bias`` (None: causal) [1 or B, 1, q, past + q] with the keys out of each query's window masked,
    over cache slots ``start``.. (``sliding_bias``): [1 or B, 1, q, past + q - start]."""
    q_len = position_ids.shape[1]
    if bias is None:
        bias = causal_bias(q_len, past, torch.float32, position_ids.device)
    offset = position_ids[:, :1] - past  # [B, 1]
    key_positions = torch.cat([torch.arange(start, past, device=position_ids.device)[None] + offset,
                               position_ids], dim=1)  # [B, past + q - start]
    far = position_ids[:, :, None] - key_positions[:, None, :] >= window  # [B, q, K]
    return bias[..., start:].masked_fill(far[:, None], torch.finfo(bias.dtype).min)


def unsupported_reason(model: Any) -> str | None:
    """Why ``GemmaDecoder`` cannot run ``model`` (None when it can)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in GEMMA_MODEL_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {GEMMA_MODEL_TYPES}"
    if getattr(cfg, "hidden_activation", None) not in ("gelu_pytorch_tanh", "gelu_tanh"):
        return f"activation {getattr(cfg, 'hidden_activation', None)!r} is not gelu-tanh"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            return f"{name.replace('_', ' ')}"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if set(cfg.layer_types) - {SLIDING, FULL}:
        return f"layer types {sorted(set(cfg.layer_types) - {SLIDING, FULL})}"
    if not hasattr(getattr(model, "model", None), "rotary_emb"):
        return "no rotary embedding module at model.model.rotary_emb"
    return None


@dataclasses.dataclass
class GemmaLayer:
    """A Gemma-3 decoder layer for inference: the (1 + w) scales of its six RMSNorms, fused q/k/v
    and gate/up products, its layer type and window (None: full attention)."""

    input_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor
    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    layer_type: str
    window: int | None

    def matrices(self) -> tuple[PackedLinear, ...]:
        return self.qkv, self.o, self.gate_up, self.down


def gemma_stack(compiled: Any, num_heads: int, scale: float, eps: float, layers: Sequence[GemmaLayer],
                layer_types: Sequence[str]) -> Any:
    """The compiled kernels' ``GemmaStack`` of ``layers`` (their weights handed over once; each forward then
    runs all of them in one call); a layer's kind is its type's index in ``layer_types``."""
    stack = compiled.GemmaStack(num_heads, scale, eps)
    for layer in layers:
        norms = [layer.input_norm, layer.q_norm, layer.k_norm, layer.post_attention_norm,
                 layer.pre_feedforward_norm, layer.post_feedforward_norm]
        stack.add([n.contiguous() for n in norms], [lin.kernel_product() for lin in layer.matrices()],
                  layer_types.index(layer.layer_type))
    return stack


class GemmaDecoder(HeadAndCache):
    """Gemma-3's decoder stack + tied LM head (the interface of ``LeanDecoder``). Rows of a batch
    share the cache length."""

    def __init__(self, model: Any, kernels: bool = True, encode: bool = True, int8_activations: bool = False) -> None:
        """``kernels``: in fp32 on CPU, the products of 1-16 rows by the compiled streamed kernel where
        it runs; ``encode``: with it, weights that are exact block encodings are streamed from their codes;
        ``int8_activations``: as for ``LeanDecoder``."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"GemmaDecoder cannot run this model: {reason}")
        cfg, inner = model.config, model.model
        stream = kernels and head_is_fp32_cpu(model) and cpu_kernels() is not None
        self.argmax_op = cpu_kernels().argmax_rows if stream else None
        int8 = int8_activations_here(int8_activations, stream)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # the compiled kernels' RMSNorm and attention (row-independent: a tree node gets a plain step's bits)
        # for one sequence of 1-16 rows, where they run (``eagle.runtime.kernels``)
        self.compiled = cpu_kernels() if stream and attention_takes(self.head_dim) else None
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens  # scales by sqrt(hidden) in the embedding's dtype
        self.rotary = inner.rotary_emb
        self.layer_types = tuple(sorted(set(cfg.layer_types)))
        # each layer type's attention window (None: full attention)
        self.windows = {t: cfg.sliding_window if t == SLIDING else None for t in self.layer_types}
        self.norm = norm_scale(inner.norm)
        self.head, self.greedy_head = lm_head(head_weight(model), stream, encode, int8)
        self.layers = []
        for layer, layer_type in zip(inner.layers, cfg.layer_types):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(GemmaLayer(
                input_norm=norm_scale(layer.input_layernorm), q_norm=norm_scale(attn.q_norm),
                k_norm=norm_scale(attn.k_norm), post_attention_norm=norm_scale(layer.post_attention_layernorm),
                pre_feedforward_norm=norm_scale(layer.pre_feedforward_layernorm),
                post_feedforward_norm=norm_scale(layer.post_feedforward_layernorm),
                qkv=product([attn.q_proj, attn.k_proj, attn.v_proj], stream, encode, int8),
                o=product([attn.o_proj], stream, encode, int8),
                gate_up=product([mlp.gate_proj, mlp.up_proj], stream, encode, int8),
                down=product([mlp.down_proj], stream, encode, int8),
                layer_type=layer_type, window=self.windows[layer_type]))
        check_int8_activations(int8, [lin for layer in self.layers for lin in layer.matrices()] + [self.head])
        self.stack = None if self.compiled is None else gemma_stack(self.compiled, self.num_heads, self.scale,
                                                                    self.eps, self.layers, self.layer_types)

    def kernel_choice(self) -> str:
        """Which kernels run the forward (timings measured with one choice do not hold for another)."""
        first = self.layers[0]
        matrices = (self.head, *first.matrices())
        streamed = "streamed products, " if self.head.stream_op is not None or isinstance(self.head, GGUFLinear) else ""
        layers = "gemma3 compiled layer stack" if self.compiled is not None else "gemma3 torch layers"
        return f"{layers}, {streamed}" + coded_weights(matrices) + screened(self.greedy_head) + repr(
            [sorted(lin.plain_rows) for lin in matrices])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: StaticCache,
                attention_mask: torch.Tensor | None = None, aux_layers: Sequence[int] = ()) -> torch.Tensor:
        """``input_ids``/``position_ids`` [B, q]; ``attention_mask`` additive [1 or B, 1, q, past + q]
        or None (causal), for the full-attention layers (sliding-window layers add their window:
        ``sliding_bias``). Returns the final-norm hidden states [B, q, H], followed along the last
        dim by the outputs of layers ``aux_layers`` ([B, q, (1 + n) H]); ``cache`` is extended."""
        b, q_len = input_ids.shape
        past = cache.get_seq_length()
        x = self.embed(input_ids)
        if self.compiled is not None and b == 1 and runs_stack(q_len, attention_mask is not None):
            return self._stack_rows(x[0], position_ids[0], [cache], [q_len], [attention_mask], aux_layers)[None]
        rope = {t: tuple(c[:, None] for c in self.rotary(x, position_ids, t)) for t in self.layer_types}
        if attention_mask is None and q_len > 1:
            attention_mask = causal_bias(q_len, past, x.dtype, x.device)
        masks: dict[int | None, tuple[torch.Tensor | None, int]] = {None: (attention_mask, 0)}
        for layer in self.layers:
            if layer.window not in masks:
                masks[layer.window] = sliding_bias(attention_mask, position_ids, past, layer.window)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # every key stored; attention over the slots from the window's start, masked within it
            mask, start = masks[self.layers[i].window]
            keys, values = cache.update(i, k, v)
            out = F.scaled_dot_product_attention(q, keys[..., start:, :], values[..., start:, :],
                                                 attn_mask=None if mask is None else mask.to(q.dtype),
                                                 enable_gqa=self.num_kv_heads != self.num_heads, scale=self.scale)
            return out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim)

        return with_aux(self, x, rope, attend, aux_layers)

    @torch.inference_mode()
    def segment_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, caches: Sequence[StaticCache],
                        sizes: Sequence[int], masks: Sequence[torch.Tensor | None],
                        aux_layers: Sequence[int] = ()) -> torch.Tensor:
        """``forward`` for several sequences in one call of the compiled ``GemmaStack`` (the weights read
        once for all rows): ``input_ids``/``position_ids`` [R], the rows of S sequences one after
        another, ``sizes`` [S] (sum R; each as ``runs_stack`` allows); sequence s's rows extend ``caches[s]`` and
        attend under ``masks[s]`` (as ``forward``'s mask; None: causal). Each row gets the bits of its
        sequence's ``forward`` alone. Returns [R, (1 + n) H]."""
        if self.stack is None or not all(runs_stack(n, m is not None) for n, m in zip(sizes, masks)):
            raise ValueError("GemmaDecoder.segment_forward: the compiled stack, 1-16 rows a causal sequence")
        return self._stack_rows(self.embed(input_ids[None])[0], position_ids, caches, sizes, masks, aux_layers)

    def _stack_rows(self, x: torch.Tensor, position_ids: torch.Tensor, caches: Sequence[StaticCache],
                    sizes: Sequence[int], masks: Sequence[torch.Tensor | None],
                    aux_layers: Sequence[int]) -> torch.Tensor:
        """Embedded rows x [R, H] of S sequences (``sizes`` [S], 1-16 each) at ``position_ids`` [R] through every
        layer in one call of the compiled ``GemmaStack`` -> [R, (1 + n) H]. Each row's result depends only on its
        own keys (the attention lists them, masked ones left out), so a tree node gets the bits of the plain step
        and a sequence in a batch those it gets alone."""
        x = x.contiguous()
        cos, sin = self._rotary_tables(x, position_ids[None])
        starts, biases, start = [], [], 0
        for cache, n, mask in zip(caches, sizes, masks):
            past = cache.get_seq_length()
            biases.append(self._kind_biases(mask, position_ids[None, start:start + n], past))
            starts.append(cache.reserve_layers(x.new_empty(1, self.num_kv_heads, n, self.head_dim)))
            start += n
        aux = self.stack.forward_segments(x, cos, sin, list(sizes), starts, [c.keys for c in caches],
                                          [c.values for c in caches], biases, list(aux_layers))
        return torch.cat([self.compiled.rms_norm(x, self.norm, self.eps)] + aux, dim=-1)

    def _rotary_tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The compiled stack's rotary tables for x [q, H] at ``position_ids`` [1, q]: (cos, sin), each a
        [q, d] table per layer type."""
        tables = [self.rotary(x[None], position_ids, t) for t in self.layer_types]  # ([1, q, d], [1, q, d])
        return [c[0].contiguous() for c, _ in tables], [s[0].contiguous() for _, s in tables]

    def _kind_biases(self, mask: torch.Tensor | None, position_ids: torch.Tensor,
                     past: int) -> list[torch.Tensor | None]:
        """The compiled stack's attention bias per layer type for q rows at ``position_ids`` [1, q] after
        ``past`` cached ones under ``mask`` (as ``forward``'s): [q, past + q], the window's keys
        masked in sliding-window layers; None: causal over keys all within the window."""
        q_len = position_ids.shape[1]
        full = None if mask is None else mask[0, 0].contiguous()
        return [full if window is None else None if mask is None and past + q_len <= window else
                window_bias(mask, position_ids, past, window)[0, 0].contiguous()
                for window in (self.windows[t] for t in self.layer_types)]

    def layer_body(self, layer: GemmaLayer, x: torch.Tensor, attend: Callable) -> torch.Tensor:
        """``eagle.runtime.layers.gemma_layer`` with this forward's heads and epsilon."""
        return gemma_layer(layer, x, attend, self.num_heads, self.num_kv_heads, self.eps)

    def rope_key(self, layer: GemmaLayer) -> str:
        """Which rotary table a layer reads: its layer type's (local or global theta)."""
        return layer.layer_type

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The features the head reads."""
        return gemma_norm(x, self.norm, self.eps)
