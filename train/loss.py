"""The EAGLE-1/2 training loss (pure): SmoothL1 feature regression + soft cross-entropy of the
draft logits against the target's token distribution, masked to assistant positions."""

from __future__ import annotations

import dataclasses

import torch


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
    target_p = torch.softmax(target_logits.float(), dim=-1)
    ce = -(target_p * torch.log_softmax(draft_logits.float(), dim=-1)).sum(-1)
    smooth_l1 = (l1 * m).sum() / denom
    ce_mean = (ce * m).sum() / denom
    top1 = ((draft_logits.argmax(-1) == target_logits.argmax(-1)).float() * m).sum() / denom
    return LossOutput(total=feature_weight * smooth_l1 + ce_weight * ce_mean, smooth_l1=smooth_l1, ce=ce_mean,
                      top1=top1.detach())


def uniform_noise(features: torch.Tensor, amplitude: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """features + U(-a, a), the input-feature noise of EAGLE training."""
    if amplitude <= 0:
        return features
    noise = torch.rand(features.shape, generator=generator, device="cpu").to(features.device, features.dtype)
    return features + (noise * 2 - 1) * amplitude
