"""The feature-level drafters: EAGLE-1/2 (``kind`` "eagle") and EAGLE-3 (``kind`` "eagle3").

EAGLE-3: the outputs of the target layers ``aux_layers`` [..., n H] -> ``fc`` (n H -> H, no bias)
-> one decoder layer whose attention reads cat(input_layernorm(token embedding), hidden_norm(x))
(2H -> q/k/v; residual x) -> the output hidden state, which is what deeper tree levels feed on
instead of target features; logits = ``lm_head(norm(hidden))`` over the draft vocabulary.

EAGLE-1/2 input: concat(embedding of token t+1, target feature f_t) -> ``fc`` (2H -> H) -> N Llama-style
decoder layers (layer 0 without input layernorm, no final norm) -> predicted feature f_{t+1}.
With ``aux_layers`` (EAGLE-3 style feature fusion) ``fc`` also reads the outputs of those target
layers at t, RMS-normalized ((2 + n) H -> H); where they do not exist (a draft token's own
prediction, deeper in the tree) they are zeros.
Token logits come from the target's frozen LM head, or from the drafter's own head over a
reduced draft vocabulary (``draft_vocab_size``, with the ``d2t`` draft-to-target id map).
The target's embedding is reused and never stored in the drafter checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from eagle.config import from_dict
from eagle.errors import EagleError
from eagle.runtime.kv_cache import StaticCache
from eagle.runtime.kernels import STREAM_MAX_ROWS, attention_fits, cpu_kernels
from eagle.runtime.decoder import LayerWeights, PackedLinear, decoder_stack, rms_norm, rotate, to_huge_pages
from eagle.runtime.layers import llama_layer, rotated
from eagle.runtime.quant_blocks import BLOCK, CODES, FORMATS, SCALES, BlockCodes, decode, unpack_state
from eagle.runtime.masks import causal_bias
from eagle.drafting import checkpoint_formats
from eagle.drafting.drafter_config import FORMAT, DrafterConfig, TargetInfo, default_eagle3_layers
from eagle.drafting.weights import SafetensorsRows, check_state, read_safetensors


def most_frequent(token_counts: torch.Tensor, n: int) -> torch.Tensor:
    """[V] token counts -> the ``n`` most frequent token ids, sorted (a draft vocabulary)."""
    return torch.topk(token_counts.float(), n).indices.sort().values


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def fc_input(features: torch.Tensor, token_embeds: torch.Tensor, cfg: DrafterConfig) -> torch.Tensor:
    """What ``fc`` reads: concat(embedding, feature, RMS-normalized aux outputs). ``features``
    [..., H] (a prediction: aux taken as zeros) or [..., (1 + n) H]; -> [..., (2 + n) H]."""
    h, n = cfg.hidden_size, len(cfg.aux_layers)
    if not n:
        return torch.cat([token_embeds, features], dim=-1)
    if features.shape[-1] == h:
        aux = features.new_zeros(*features.shape[:-1], n * h)
    else:
        aux = features[..., h:].unflatten(-1, (n, h))
        aux = nn.functional.rms_norm(aux.float(), (h,), eps=cfg.rms_norm_eps).to(features.dtype).flatten(-2)
    return torch.cat([token_embeds, features[..., :h], aux], dim=-1)


def fused_input(fc: Callable[[torch.Tensor], torch.Tensor], features: torch.Tensor, token_embeds: torch.Tensor,
                cfg: DrafterConfig) -> torch.Tensor:
    """The residual stream a drafter's layers start from, [..., H]. "eagle": ``fc(fc_input(...))``.
    "eagle3": ``features`` [..., (1 + n) H] are target features (the last hidden state, unused, then
    the n aux layers' outputs), fused by ``fc``; [..., H] is the drafter's own output hidden state
    (deeper in a tree, or a later training-time-test step), taken as it is."""
    if cfg.kind != "eagle3":
        return fc(fc_input(features, token_embeds, cfg))
    h = cfg.hidden_size
    if features.shape[-1] == h:
        return features
    if features.shape[-1] != (1 + len(cfg.aux_layers)) * h:
        raise EagleError(f"eagle3 drafter: features of width {features.shape[-1]}, expected {h} (its own hidden "
                         f"states) or {(1 + len(cfg.aux_layers)) * h} (target features with {len(cfg.aux_layers)} "
                         f"aux layers)")
    return fc(features[..., h:])


def rotary_angles(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """Llama's default rotary embedding: positions [...] -> angles [..., dim] (float32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    angles = positions.float()[..., None] * inv_freq
    return torch.cat((angles, angles), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding. q/k [B, heads, T, d]; positions [B, T]."""
    emb = rotary_angles(positions, q.shape[-1], theta)[:, None]
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return rotate(q, cos, sin), rotate(k, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int) -> None:
        super().__init__()
        self.cfg, self.index = cfg, index
        h, d = cfg.hidden_size, cfg.head_dim
        width = 2 * h if cfg.kind == "eagle3" else h  # EAGLE-3: cat(normed embedding, normed hidden)
        self.q_proj = nn.Linear(width, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(width, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(width, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor,
                cache: StaticCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        q, k = rope(q, k, positions, self.cfg.rope_theta)
        if cache is not None:
            k, v = cache.update(self.index, k, v)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), enable_gqa=True,
                                                         scale=1.0 / math.sqrt(d))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """EAGLE-1 layout: the first layer reads the fc output directly (no input layernorm). EAGLE-3
    (the SpecForge / vLLM names): ``input_layernorm`` normalizes the token embedding,
    ``hidden_norm`` the hidden state, and attention reads their concatenation."""

    def __init__(self, cfg: DrafterConfig, index: int) -> None:
        super().__init__()
        eagle3 = cfg.kind == "eagle3"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if index > 0 or eagle3 else None
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if eagle3 else None
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor,
                cache: StaticCache | None, token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if self.hidden_norm is not None:
            h = torch.cat([self.input_layernorm(token_embeds), self.hidden_norm(x)], dim=-1)
        else:
            h = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attn(h, positions, bias, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """An EAGLE drafter of either kind. ``forward`` maps (features, next-token embeddings) to the
    output hidden states (EAGLE-1/2: predicted features), ``draft_logits`` those to draft logits."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        self.source = ""  # the folder it was loaded from (``from_pretrained``), for reports
        eagle3 = cfg.kind == "eagle3"
        fc_in = len(cfg.aux_layers) if eagle3 else 2 + len(cfg.aux_layers)
        self.fc = nn.Linear(fc_in * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if eagle3 else None
        if cfg.draft_vocab_size is not None or eagle3:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size or cfg.vocab_size, bias=False)
            self.register_buffer("d2t", torch.arange(self.lm_head.out_features, dtype=torch.long))
        else:
            self.lm_head = None
            self.d2t = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_target(cls, target: Any, token_counts: torch.Tensor | None = None, **overrides: Any) -> "Drafter":
        """An untrained drafter shaped for ``target`` (an ``eagle.Target``). With
        ``draft_vocab_size=N`` the draft vocabulary is the N most frequent tokens in
        ``token_counts`` [V] (lowest ids when none are given); its head starts from the
        target's LM-head rows. ``kind="eagle3"`` without ``aux_layers`` fuses the target layers
        that vLLM and llama.cpp default to (their 2, L/2, L-3: outputs of ours 1, L/2-1, L-4), and
        its final norm starts from the target's."""
        tc = target.config
        rope_params = getattr(tc, "rope_parameters", None) or {}
        rope_params = rope_params.get("full_attention", rope_params)  # per layer type (Gemma-3): the global one
        fields = dict(
            hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", tc.num_attention_heads),
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            vocab_size=target.vocab_size, rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=float(rope_params.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
            max_position_embeddings=target.max_context,
            target=TargetInfo(name=target.name, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                              tokenizer_fingerprint=target.tokenizer_fingerprint))
        fields.update(overrides)
        if fields.get("kind") == "eagle3" and not fields.get("aux_layers"):
            fields["aux_layers"] = default_eagle3_layers(tc.num_hidden_layers)
        drafter = cls(from_dict(DrafterConfig, fields, where="drafter overrides"))
        if drafter.lm_head is not None:
            n = drafter.lm_head.out_features
            ids = most_frequent(token_counts, n) if token_counts is not None and n < target.vocab_size \
                else torch.arange(n)
            drafter.d2t.copy_(ids)
            with torch.no_grad():
                drafter.lm_head.weight.copy_(target.model.get_output_embeddings().weight[ids.to(target.device)].float())
        final_norm = getattr(getattr(target.model, "model", None), "norm", None)
        # the lean forward's final-norm scale is the factor applied ((1 + w) for Gemma), the module's weight is not
        scale = target.lean.norm if target.lean is not None else getattr(final_norm, "weight", None)
        if drafter.norm is not None and scale is not None:
            with torch.no_grad():
                drafter.norm.weight.copy_(scale.float())
        return drafter.to(device=target.device, dtype=target.dtype)

    @torch.no_grad()
    def with_draft_vocab(self, ids: torch.Tensor, target: Any) -> "Drafter":
        """A copy whose draft vocabulary is the target token ids ``ids`` [N] (sorted, unique).
        Rows of tokens already in the vocabulary are kept. The others start from the target's
        LM-head rows mapped into this head's space by a least-squares fit [H, H] over the kept
        tokens (a trained head co-adapts with its features, so raw target rows would not do)."""
        if self.lm_head is None:
            raise EagleError("this drafter uses the target's LM head: it has no draft vocabulary to resize")
        ids = ids.to(self.d2t.device)
        if ids.ndim != 1 or not torch.equal(ids, torch.unique(ids)) or not 0 < ids.numel() <= self.config.vocab_size:
            raise EagleError("draft vocabulary ids must be sorted, unique target token ids")
        config = dataclasses.replace(self.config, draft_vocab_size=int(ids.numel()))
        drafter = type(self)(config).to(device=self.d2t.device, dtype=self.lm_head.weight.dtype)
        drafter.load_state_dict({k: v for k, v in self.state_dict().items() if k not in ("lm_head.weight", "d2t")},
                                strict=False)
        target_rows = target.model.get_output_embeddings().weight.to(self.lm_head.weight)
        old_ids = self.d2t
        mapping = torch.linalg.lstsq(target_rows[old_ids].float(), self.lm_head.weight.float()).solution
        rows = (target_rows[ids].float() @ mapping).to(self.lm_head.weight.dtype)
        position = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
        position[old_ids] = torch.arange(old_ids.numel(), device=ids.device)
        kept = position[ids] >= 0
        rows[kept] = self.lm_head.weight[position[ids][kept]]
        drafter.lm_head.weight.copy_(rows)
        drafter.d2t.copy_(ids)
        return drafter

    @torch.no_grad()
    def with_aux_layers(self, layers: list[int]) -> "Drafter":
        """A copy that also fuses the outputs of target ``layers`` (appended to its own aux
        layers), their ``fc`` columns zero: it predicts exactly what this drafter does until
        trained (a warm start for EAGLE-3 style fusion). EAGLE-1/2 drafters only."""
        if self.config.kind != "eagle":
            raise EagleError("with_aux_layers widens an EAGLE-1/2 drafter's fc; an eagle3 drafter's layers are fixed")
        config = dataclasses.replace(self.config, aux_layers=self.config.aux_layers + list(layers))
        drafter = type(self)(config).to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        state = self.state_dict()
        weight = torch.zeros_like(drafter.fc.weight)
        weight[:, : self.fc.weight.shape[1]] = state.pop("fc.weight")
        state["fc.weight"] = weight
        drafter.load_state_dict(state)
        return drafter

    @torch.no_grad()
    def with_layers(self, num_layers: int) -> "Drafter":
        """A copy with decoder layers appended up to ``num_layers``, each new layer's output
        projections (``o_proj``, ``down_proj``) zero so that it adds nothing to the residual
        stream: it predicts exactly what this drafter does until trained (a warm start for a
        deeper drafter)."""
        if self.config.kind != "eagle" and num_layers != self.config.num_layers:
            raise EagleError("an eagle3 drafter has one decoder layer")
        if num_layers < self.config.num_layers:
            raise EagleError(f"cannot shrink a drafter from {self.config.num_layers} to {num_layers} layers")
        config = dataclasses.replace(self.config, num_layers=num_layers)
        drafter = type(self)(config).to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        loaded = drafter.load_state_dict(self.state_dict(), strict=False)
        appended = tuple(f"layers.{i}." for i in range(self.config.num_layers, num_layers))
        stray = loaded.unexpected_keys + [k for k in loaded.missing_keys if not k.startswith(appended)]
        if stray:  # only the appended layers may lack weights; anything else means the copy is not this drafter
            raise EagleError(f"with_layers: weights that do not match the deeper drafter: {stray}")
        for layer in drafter.layers[self.config.num_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        return drafter

    def check_target(self, target: Any) -> None:
        """Refuse a target other than the one this drafter was built for."""
        info = self.config.target
        layers = target.model.config.num_hidden_layers
        if any(i >= layers - 1 for i in self.config.aux_layers):
            raise EagleError(f"aux_layers {self.config.aux_layers} must name target layers below its last "
                             f"({target.name} has {layers} layers; the last one's output is the feature itself)")
        if info.hidden_size != target.hidden_size or info.vocab_size != target.vocab_size:
            raise EagleError(
                f"drafter was built for {info.name or 'another target'} (hidden {info.hidden_size}, vocab "
                f"{info.vocab_size}), but the target {target.name} has hidden {target.hidden_size}, vocab {target.vocab_size}")
        if info.tokenizer_fingerprint and info.tokenizer_fingerprint != target.tokenizer_fingerprint:
            raise EagleError(f"drafter was built for {info.name or 'another target'} whose tokenizer differs from "
                             f"that of {target.name}")

    # ---- persistence ---------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` + ``model.safetensors`` to ``directory``, crash-safe: a kill at any
        instant leaves the old drafter or the new one (``eagle.atomic.atomic_directory``; other
        files already in the folder, such as a model card, are kept)."""
        from safetensors.torch import save_file

        from eagle.atomic import atomic_directory

        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        with atomic_directory(directory, keep_other_files=True) as tmp:
            (tmp / "config.json").write_text(self.config.to_json())
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": FORMAT})

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: Any = None, device: Any = None,
                        dtype: torch.dtype | None = None, allow_pickle: bool = False) -> "Drafter":
        """Load ``config.json`` + ``model.safetensors``, ours or in an EAGLE-1/2 or EAGLE-3 release
        layout (``eagle.drafting.checkpoint_formats``; a ``pytorch_model.bin`` only with ``allow_pickle``, as
        unpickling can run code). With ``target`` given, check that it is the target the drafter was
        built for and move the drafter to its device and dtype; an EAGLE-3 config naming no aux
        layers then gets the consumers' default for that target, and an embedding stored in an
        EAGLE-3 checkpoint must be the target's."""

        directory = Path(directory)
        layout = checkpoint_formats.detect_format(raw := read_config_json(directory))
        if layout == checkpoint_formats.EAGLE3_LAYOUT:
            cfg, state = checkpoint_formats.load_eagle3_checkpoint(
                directory, raw, allow_pickle=allow_pickle, shapes=lambda c: skeleton(cls, c).state_dict(),
                target_layers=None if target is None else target.model.config.num_hidden_layers,
                target_embedding=None if target is None else target.model.get_input_embeddings().weight)
            drafter = load_into_skeleton(skeleton(cls, cfg), state)
        elif layout != FORMAT:
            cfg, state = checkpoint_formats.load_eagle_checkpoint(directory, raw, allow_pickle=allow_pickle,
                                                     shapes=lambda c: skeleton(cls, c).state_dict())
            drafter = load_into_skeleton(skeleton(cls, cfg), state)
        else:
            if not (directory / "model.safetensors").is_file():
                raise EagleError(f"no drafter weights at {directory}: model.safetensors missing")
            drafter = skeleton(cls, DrafterConfig.from_json(directory / "config.json"))
            state = unpack_state(read_safetensors(directory / "model.safetensors"))
            check_state(drafter.state_dict(), state, f"drafter weights {directory / 'model.safetensors'}")
            load_into_skeleton(drafter, state)
        check_d2t(drafter.d2t, drafter.config, directory)
        if target is not None:
            drafter.check_target(target)
            device, dtype = device or target.device, dtype or target.dtype
        drafter.source = str(directory)
        return drafter.to(device=device, dtype=dtype).eval()

    # ---- compute ---------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                cache: StaticCache | None = None, attention_bias: torch.Tensor | None = None) -> torch.Tensor:
        """``features`` [B, T, H] (f_t, or an eagle3 drafter's own output; or [B, T, (1 + n) H] with
        the n aux layers' outputs),
        ``token_embeds`` [B, T, H] (embedding of token t+1),
        ``positions`` [B, T], ``attention_bias`` [B or 1, 1, T, past + T] additive (causal when
        None) -> predicted features [B, T, H] (f_{t+1}). ``cache`` is extended in place."""
        x = fused_input(self.fc, features, token_embeds, self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if attention_bias is None:
            attention_bias = causal_bias(x.shape[1], past, x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, positions, attention_bias, cache, token_embeds)
        return x

    def new_cache(self) -> StaticCache:
        return StaticCache(self.config.num_layers)

    def draft_logits(self, hidden: torch.Tensor, target_lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Predicted features (eagle3: output hidden states) [..., H] -> logits over the draft vocabulary
        [..., V_draft] (eagle3: through its final norm)."""
        if self.norm is not None:
            hidden = self.norm(hidden)
        head = self.lm_head if self.lm_head is not None else target_lm_head
        return head(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]


def read_config_json(directory: Path) -> dict:
    """A drafter folder's ``config.json`` as a dict; ``EagleError`` when missing or not a JSON object."""
    if not (directory / "config.json").is_file():
        raise EagleError(f"no drafter at {directory}: config.json missing")
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise EagleError(f"cannot read {directory / 'config.json'}: {exc}") from exc
    if not isinstance(raw, dict):
        raise EagleError(f"{directory / 'config.json'} is not a JSON object")
    return raw


def check_d2t(d2t: torch.Tensor | None, cfg: DrafterConfig, directory: Path) -> None:
    """Refuse a draft-to-target id map with ids outside the target's vocabulary."""
    if d2t is not None and not (0 <= int(d2t.min()) and int(d2t.max()) < cfg.vocab_size):
        raise EagleError(f"drafter at {directory}: its draft-to-target id map d2t holds ids outside "
                         f"0..{cfg.vocab_size - 1}")


def skeleton(cls: type[Drafter], cfg: DrafterConfig) -> Drafter:
    """A drafter of ``cfg`` whose tensors have no storage (the meta device): its shapes, or a module for
    ``load_into_skeleton`` to fill without first allocating and initializing weights that are overwritten."""
    with torch.device("meta"):
        return cls(cfg)


def load_into_skeleton(drafter: Drafter, state: dict[str, torch.Tensor]) -> Drafter:
    """``drafter`` (a ``skeleton``) holding the tensors of ``state`` themselves, each in the dtype the
    module gives it (cast where it differs): one copy of the weights in memory while loading, not two
    (those of a plain safetensors file stay mapped from it, copy-on-write, as safetensors reads them).
    Keys must match exactly, as in ``load_state_dict``."""
    reference = drafter.state_dict()
    drafter.load_state_dict({k: v.to(reference[k].dtype) if k in reference else v for k, v in state.items()},
                            assign=True)
    return drafter


class _ModuleWeights:
    """A ``Drafter``'s tensors by state-dict name, as ``LeanDrafter`` reads them (``DrafterFile``'s interface)."""

    def __init__(self, drafter: Drafter) -> None:
        self.config, self.device, self.dtype = drafter.config, drafter.fc.weight.device, drafter.fc.weight.dtype
        self._tensors = drafter.state_dict(keep_vars=True)
        self.shapes = {name: tuple(t.shape) for name, t in self._tensors.items()}

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name].detach()

    def matrix(self, names: list[str], bits: int) -> torch.Tensor:
        """The weights ``names`` stacked by rows."""
        parts = [self.tensor(name) for name in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclasses.dataclass(eq=False)
class DrafterFile:
    """A drafter folder in eagle's own format (plain, or packed by ``eagle.runtime.quant_blocks.pack_state``) for a
    target on a CPU, opened (``open``: the config, the checks ``Drafter.from_pretrained`` makes, the tensors'
    shapes from the file's header) without reading its weights into a module. ``LeanDrafter(file, quant=...)``
    reads them from the file one matrix at a time, a few rows at a time, so that its codes are all a decoding
    process holds of the drafter (an fp32 module beside them would add 4 bytes a weight; docs/targets.md).
    ``load()``: the ``Drafter`` itself, read on first call."""

    directory: Path
    config: DrafterConfig
    target: Any
    reader: SafetensorsRows
    module: Drafter | None = None

    @classmethod
    def open(cls, directory: str | Path, target: Any) -> "DrafterFile | None":
        """The folder opened, or None when it holds another layout (an EAGLE release: ``Drafter.from_pretrained``
        converts it). ``EagleError`` for what ``Drafter.from_pretrained`` refuses."""
        directory = Path(directory)
        if checkpoint_formats.detect_format(read_config_json(directory)) != FORMAT:
            return None
        if not (directory / "model.safetensors").is_file():
            raise EagleError(f"no drafter weights at {directory}: model.safetensors missing")
        file = cls(directory, DrafterConfig.from_json(directory / "config.json"), target,
                   SafetensorsRows(directory / "model.safetensors"))
        shell = skeleton(Drafter, file.config)
        check_state(shell.state_dict(), {name: torch.empty(shape, device="meta") for name, shape in file.shapes.items()},
                    f"drafter weights {directory / 'model.safetensors'}")
        check_d2t(file.tensor("d2t") if file.has("d2t") else None, file.config, directory)
        shell.check_target(target)
        return file

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each weight's shape by its name in the module (a packed weight's: its codes')."""
        out = {}
        for name, shape in self.reader.shapes.items():
            if name.endswith(SCALES):
                continue
            if name.endswith(CODES):
                name = name[:-len(CODES)]
                if name + SCALES not in self.reader.shapes:
                    raise EagleError(f"drafter weights {self.reader.path}: packed weight {name} has codes but no "
                                     f"{name + SCALES}")
            out[name] = shape
        return out

    def has(self, name: str) -> bool:
        return name in self.shapes

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a weight, as the module would hold them (floats in the target's dtype)."""
        if name + CODES in self.reader.shapes:
            codes = BlockCodes(self.reader.rows(name + CODES, start, stop),
                               self.reader.rows(name + SCALES, start, stop).float().unsqueeze(-1))
            return decode(codes).to(self.dtype)
        out = self.reader.rows(name, start, stop)
        return out.to(self.dtype) if out.is_floating_point() else out

    def tensor(self, name: str) -> torch.Tensor:
        return self.rows(name, 0, self.shapes[name][0])  # a drafter holds no scalars (``open`` checked the shapes)

    def matrix(self, names: list[str], bits: int) -> "BlockCodes | _StackedRows":
        """The weights ``names`` stacked by rows, for ``PackedLinear.quantized``: their stored 8-bit codes when
        every one is packed and ``bits`` is 8, else their rows read on demand."""
        if bits == 8 and all(name + CODES in self.reader.shapes for name in names):
            return BlockCodes(torch.cat([self.reader.tensor(name + CODES) for name in names]),
                              torch.cat([self.reader.tensor(name + SCALES) for name in names]).float().unsqueeze(-1))
        return _StackedRows(self, names)

    def load(self) -> Drafter:
        if self.module is None:
            self.module = Drafter.from_pretrained(self.directory, target=self.target)
        return self.module


class _StackedRows:
    """Weights of a ``DrafterFile`` stacked by rows [sum N, K], read a few rows at a time (``block_quantize``)."""

    def __init__(self, file: DrafterFile, names: list[str]) -> None:
        self.file, self.names = file, names
        self.sizes = [file.shapes[name][0] for name in names]
        self.shape = torch.Size([sum(self.sizes), file.shapes[names[0]][1]])
        self.device = file.device

    def dim(self) -> int:
        return 2

    def detach(self) -> "_StackedRows":
        return self

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, _ = rows.indices(self.shape[0])
        parts, offset = [], 0
        for name, size in zip(self.names, self.sizes):
            lo, hi = max(start - offset, 0), min(stop - offset, size)
            if lo < hi:
                parts.append(self.file.rows(name, lo, hi))
            offset += size
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class LeanDrafter(nn.Module):
    """Inference-only forward of a ``Drafter`` (as ``eagle.runtime.decoder.LeanDecoder`` is for targets): q/k/v
    and gate/up fused into one prepacked matrix each (``PackedLinear``), rotary tables computed
    once, weights cast to ``dtype``. Same ``forward`` as ``Drafter``, and the parts the tree
    proposer uses (``config``, ``device``, ``draft_logits``, ``to_target_ids``, ``new_cache``). The tree's
    drafter calls have ~10 rows, where a call's fixed cost outweighs its arithmetic: in fp32 on
    a CPU where the compiled kernels run (``eagle.runtime.kernels``), a call of one sequence of at most
    16 rows runs its decoder layers in one call (``eagle.runtime.decoder.decoder_stack``), as
    ``eagle.runtime.decoder.LeanDecoder`` does for targets."""

    to_target_ids = Drafter.to_target_ids
    new_cache = Drafter.new_cache

    def __init__(self, drafter: "Drafter | DrafterFile", dtype: torch.dtype | None = None,
                 quant: str | None = None) -> None:
        """``quant``: a format of ``eagle.runtime.quant_blocks.FORMATS`` ("q8_0", "q4_1"): the matrices rounded to
        it (lossy) and computed in fp32, read from their codes by the compiled kernels where they
        run; a matrix whose input size is not a multiple of 32 stays as it is. ``drafter``: a module, or a
        ``DrafterFile`` whose weights are read from the file one matrix at a time (8-bit codes stored by
        ``pack_state`` taken as they are for "q8_0": the codes quantizing the module would give)."""
        super().__init__()
        weights = drafter if isinstance(drafter, DrafterFile) else _ModuleWeights(drafter)
        self.config = weights.config
        if quant is not None and quant not in FORMATS:
            raise EagleError(f"unknown drafter quantization {quant!r}; choose from {', '.join(FORMATS)}")
        if quant is not None and dtype not in (None, torch.float32):
            raise EagleError(f"a {quant} drafter computes in float32, not {dtype}")
        self.quant = quant
        self.dtype = dtype = torch.float32 if quant else dtype or weights.dtype
        self.device = weights.device

        def packed(*names: str) -> PackedLinear:
            biases = [name + ".bias" for name in names]
            bias = torch.cat([weights.tensor(b).to(dtype) for b in biases]) if weights.has(biases[0]) else None
            if quant is not None and weights.shapes[names[0] + ".weight"][1] % BLOCK == 0:  # quantized as read
                bits = FORMATS[quant]
                return PackedLinear.quantized(weights.matrix([n + ".weight" for n in names], bits), bias, bits)
            return PackedLinear(torch.cat([weights.tensor(n + ".weight").to(dtype) for n in names]), bias,
                                encode=False)

        def norm(name: str) -> torch.Tensor | None:
            return weights.tensor(name + ".weight").to(dtype) if weights.has(name + ".weight") else None

        self.fc = packed("fc")
        eps = self.config.rms_norm_eps
        eagle3 = self.config.kind == "eagle3"  # input_layernorm normalizes the embedding, hidden_norm the hidden state

        def layer(i: int) -> LayerWeights:
            at = f"layers.{i}."
            return LayerWeights(input_norm=norm(at + ("hidden_norm" if eagle3 else "input_layernorm")), input_eps=eps,
                                qkv=packed(*(at + f"self_attn.{p}_proj" for p in "qkv")),
                                o=packed(at + "self_attn.o_proj"), post_norm=norm(at + "post_attention_layernorm"),
                                post_eps=eps, gate_up=packed(at + "mlp.gate_proj", at + "mlp.up_proj"),
                                down=packed(at + "mlp.down_proj"),
                                embed_norm=norm(at + "input_layernorm") if eagle3 else None)

        self.layers = [layer(i) for i in range(self.config.num_layers)]
        self.norm = norm("norm")
        self.lm_head = packed("lm_head") if weights.has("lm_head.weight") else None
        to_huge_pages([self.fc] + [lin for layer in self.layers for lin in layer.matrices()]
                      + ([self.lm_head] if self.lm_head is not None else []))
        self.d2t = weights.tensor("d2t").to(self.device) if weights.has("d2t") else None
        self._cos = self._sin = torch.empty(0, self.config.head_dim, dtype=dtype, device=self.device)
        on_cpu = self.device.type == "cpu"
        fits = dtype == torch.float32 and on_cpu and attention_fits(self.config.head_dim) and not eagle3
        compiled = cpu_kernels() if fits else None  # the compiled stack has no EAGLE-3 attention input
        self.stack = None if compiled is None else decoder_stack(compiled, self.config.num_attention_heads,
                                                                 1.0 / math.sqrt(self.config.head_dim), self.layers)

    def draft_logits(self, hidden: torch.Tensor, target_lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """As ``Drafter.draft_logits``."""
        if self.norm is not None:
            hidden = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        head = self.lm_head if self.lm_head is not None else target_lm_head
        return head(hidden)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, T, d] for positions [B, T], from tables grown to the largest position seen."""
        need = int(positions.max()) + 1
        if need > self._cos.shape[0]:
            size = max(need, 2 * self._cos.shape[0], 256)
            angles = rotary_angles(torch.arange(size, device=positions.device), self.config.head_dim,
                                   self.config.rope_theta)
            self._cos, self._sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        return self._cos[positions][:, None], self._sin[positions][:, None]

    @torch.inference_mode()
    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                cache: StaticCache | None = None, attention_bias: torch.Tensor | None = None) -> torch.Tensor:
        """As ``Drafter.forward``: [B, T, H] features and next-token embeddings -> predicted features."""
        cfg = self.config
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        x = fused_input(self.fc, features, token_embeds, cfg)
        b, t, _ = x.shape
        cos, sin = self.rotary(positions)
        if self.stack is not None and cache is not None and b == 1 and t <= STREAM_MAX_ROWS:
            # the layers in one call of the compiled kernels, x updated in place
            like = x.new_empty(1, nkv, t, d)  # a layer's new keys, for the cache
            bias = None if attention_bias is None else attention_bias[0, 0].contiguous()  # None: causal
            self.stack.forward(x[0], cos[0, 0], sin[0, 0], cache.keys, cache.values, cache.reserve_layers(like), bias,
                               False, [])
            return x
        past = cache.get_seq_length() if cache is not None else 0
        if attention_bias is None:
            attention_bias = causal_bias(t, past, x.dtype, x.device)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if cache is not None:
                k, v = cache.update(i, k, v)
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias.to(x.dtype),
                                                             enable_gqa=nkv != nh, scale=1.0 / math.sqrt(d))
            return out.transpose(1, 2).reshape(b, t, nh * d)

        return self.layers_with(x, token_embeds, cos, sin, attend)

    def layers_with(self, x: torch.Tensor, token_embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The decoder layers over the fused inputs x [B, T, H] (``token_embeds`` [B, T, H]: what an EAGLE-3
        layer's attention also reads; rotary tables [B, 1, T, d]); ``attend(i, q, k, v)`` (q [B, heads, T, d],
        k and v [B, kv_heads, T, d], rotated) stores layer i's keys and values and returns its attention
        output [B, T, heads d]. -> [B, T, H] (before the final norm, as ``forward``)."""
        cfg = self.config
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for i, layer in enumerate(self.layers):
            x = llama_layer(layer, x, rotated(functools.partial(attend, i), cos, sin, nh, nkv, d), nh, nkv,
                            embeds=token_embeds)
        return x
