"""The EAGLE-1/2 training loss (pure): SmoothL1 feature regression + soft cross-entropy of the
draft logits against the target's token distribution, masked to assistant positions."""

from __future__ import annotations

import dataclasses

import torch

from eagle.runtime.masks import additive_bias


@dataclasses.dataclass
class LossOutput:
    """``total`` = feature_weight * smooth_l1 + ce_weight * ce (scalars); ``top1`` the fraction of
    masked positions where the draft argmax equals the target argmax."""

    total: torch.Tensor
    smooth_l1: torch.Tensor
    ce: torch.Tensor
    top1: torch.Tensor


def eagle_loss(pred_hidden: torch.Tensor, target_hidden: torch.Tensor, draft_logits: torch.Tensor,
               target_logits: torch.Tensor, mask: torch.Tensor, ce_weight: float = 0.1,
               feature_weight: float = 1.0) -> LossOutput:
    """``pred_hidden``/``target_hidden`` [B, T, H]; ``draft_logits``/``target_logits`` [B, T, V]
    (over the same vocabulary); ``mask`` [B, T] bool. Means are over masked positions."""
    m = mask.float()
    denom = m.sum().clamp(min=1.0)
    l1 = torch.nn.functional.smooth_l1_loss(pred_hidden.float(), target_hidden.float(), reduction="none").mean(-1)
    ce = soft_cross_entropy(draft_logits, target_logits)
    smooth_l1 = (l1 * m).sum() / denom
    ce_mean = (ce * m).sum() / denom
    top1 = ((draft_logits.argmax(-1) == target_logits.argmax(-1)).float() * m).sum() / denom
    return LossOutput(total=feature_weight * smooth_l1 + ce_weight * ce_mean, smooth_l1=smooth_l1, ce=ce_mean,
                      top1=top1.detach())


def soft_cross_entropy(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] cross-entropy of the draft against the target's softmax (float32)."""
    target_p = torch.softmax(target_logits.float(), dim=-1)
    return -(target_p * torch.log_softmax(draft_logits.float(), dim=-1)).sum(-1)


def uniform_noise(features: torch.Tensor, amplitude: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """features + U(-a, a), the input-feature noise of EAGLE training (drawn on the ``generator``'s
    device: a CUDA generator keeps it off the host)."""
    if amplitude <= 0:
        return features
    where = generator.device if generator is not None else torch.device("cpu")  # drawn where the generator lives
    noise = torch.rand(features.shape, generator=generator, device=where).to(features.device, features.dtype)
    return features + (noise * 2 - 1) * amplitude


class ConcatCache:
    """Keys/values that grow by concatenation and keep autograd (the drafter's ``StaticCache``
    writes in place, which backpropagation cannot go through). For training-time unrolling."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def get_seq_length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def update(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [B, kv_heads, q, d] along the sequence; return all of the layer's entries."""
        old_k, old_v = self.keys[index], self.values[index]
        self.keys[index] = keys if old_k is None else torch.cat([old_k, keys], dim=-2)
        self.values[index] = values if old_v is None else torch.cat([old_v, values], dim=-2)
        return self.keys[index], self.values[index]


def unroll_bias(length: int, step: int, dtype: torch.dtype, device: torch.device,
                segments: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask [1, 1, T, T * (step + 1)] for unrolled step ``step`` (0-based) over the
    keys of steps 0..step concatenated (each block T long, block i from step i).

    Query t of step j is the depth-(j+1) draft from root r = t - j, as at inference: it sees the
    step-0 keys at positions <= r (made from target features, the KV cache) and, for i = 1..j,
    the step-i key at position r + i (its own chain, itself last). Queries with t < j have no
    root; they see only themselves and are left out of losses. With ``segments`` [B, T] (packed
    rows, ``train.packing``) a query also sees only keys of its own segment: [B, 1, T, T * (step + 1)]."""
    t = torch.arange(length, device=device)
    blocks = [t[None, :] <= (t[:, None] - step)]
    blocks += [t[None, :] == (t[:, None] - step + i) for i in range(1, step + 1)]
    allowed = torch.cat(blocks, dim=1)
    if segments is not None:
        same = segments[:, :, None] == segments[:, None, :]
        allowed = allowed[None] & same.repeat(1, 1, step + 1)
    return additive_bias(allowed, dtype)


def unroll(drafter: torch.nn.Module, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
           steps: int, num_layers: int, own_hidden: bool = False,
           segments: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Training-time test (HASS / EAGLE-3 style): ``steps`` drafter passes over whole sequences.
    ``features`` [B, T, F] (f_t, noised by the caller; F = H, or (1 + n) H with n aux layers'
    outputs), ``token_embeds`` [B, T, H] (token t+1), ``positions`` [B, T] -> ``steps`` predictions
    [B, T, H]. Pass j > 0 feeds pass j-1's prediction at t - 1 as the feature at t (aux outputs
    zero, as at inference), attending as ``unroll_bias`` says, so prediction j at
    position t (t >= j) equals the depth-(j+1) draft of inference from root t - j; every one
    still targets f_{t+1}. ``own_hidden`` (EAGLE-3): pass j > 0 feeds pass j-1's output hidden
    state [B, T, H] alone, as the drafter's deeper tree levels do. ``drafter`` may be a wrapper
    (a DeepSpeed engine) of a ``Drafter``. Packed rows: ``segments`` [B, T] and per-segment
    ``positions``; a query is rooted when its position is >= j, and what a segment's first
    position reads from the segment before is seen by unrooted queries only."""
    cache = ConcatCache(num_layers)
    length = features.shape[1]
    preds, feats = [], features
    for step in range(steps):
        bias = unroll_bias(length, step, features.dtype, features.device, segments)
        pred = drafter(feats, token_embeds, positions, cache=cache, attention_bias=bias)
        preds.append(pred)
        if own_hidden:  # position 0 has no root beyond step 0: what it reads is never seen by a rooted query
            feats = torch.cat([pred[:, :1], pred[:, :-1]], dim=1)
            continue
        padded = torch.nn.functional.pad(pred[:, :-1], (0, features.shape[-1] - pred.shape[-1]))
        feats = torch.cat([features[:, :1], padded], dim=1)  # position 0 has no root beyond step 0
    return preds
