"""Batched plain decoding with the lean target forward: many prompts, one forward per step.

Not speculative: it is for throughput (making training data: ``train.selfdistill``), where
batching does what drafting does for one stream. Prompts are left-padded; the padding is masked
out of every attention and each row's positions start at 0 on its first real token, so a row
decodes as it would alone (up to floating-point rounding). Rows that end are dropped from the
batch (and from the cache), so the batch only pays for the sequences still running."""

from __future__ import annotations

import dataclasses

import torch

from eagle.config import SamplingConfig
from eagle.errors import EagleError
from eagle.decoding.sampling import logits_to_probs, sample
from eagle.runtime.target import Target
from eagle.decoding.tree_mask import additive_bias


@dataclasses.dataclass
class BatchOutput:
    """Per prompt, in input order: ``token_ids`` the new tokens (the EOS that ended it excluded)
    and ``ended`` whether it stopped at an EOS (else at ``max_new_tokens``)."""

    token_ids: list[list[int]]
    ended: list[bool]


def padded_batch(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> (input ids [B, P], real-token mask [B, P], positions [B, P]);
    positions count real tokens only (0 on each row's first one; padding gets 0 too)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    real = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    return ids, real, (real.long().cumsum(1) - 1).clamp(min=0)


def batch_bias(real_keys: torch.Tensor, q_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, q, K] for the last ``q_len`` of K positions: causal, and no
    attention to padding. ``real_keys`` [B, K] (True = a real token)."""
    k_len = real_keys.shape[1]
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=real_keys.device).tril(k_len - q_len)
    return additive_bias(causal[None] & real_keys[:, None, :], dtype)


@torch.inference_mode()
def generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                   generator: torch.Generator) -> BatchOutput:
    """Decode every prompt (token ids) for up to ``max_new_tokens``, stopping each at an EOS:
    greedy or sampled as ``sampling`` says (one generator for all rows)."""
    if target.lean is None:
        raise EagleError(f"{target.name} has no lean forward; batched decoding needs one")
    if not prompts or min(len(p) for p in prompts) < 1:
        raise EagleError("generate_batch needs at least one prompt, each with at least one token")
    if max_new_tokens < 1:
        raise EagleError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > target.max_context:
        raise EagleError(f"a prompt of {longest} tokens plus {max_new_tokens} new ones exceeds the model's context "
                         f"({target.max_context})")
    device, eos = target.device, torch.tensor(sorted(target.eos_token_ids), device=target.device)
    ids, real, positions = (t.to(device) for t in padded_batch(prompts, pad_id=0))  # padding is masked: any id
    cache = target.lean.new_cache()  # rows are dropped as they end: a growable cache
    out = target.forward(ids, positions, cache, batch_bias(real, ids.shape[1], target.dtype), logits_from=ids.shape[1] - 1)
    rows = torch.arange(len(prompts), device=device)  # which prompt each batch row is
    new: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    next_pos = positions[:, -1] + 1
    for step in range(max_new_tokens):
        logits = out.logits[:, -1]
        tokens = logits.argmax(-1) if sampling.greedy else sample(logits_to_probs(logits, sampling), generator)
        stop = torch.isin(tokens, eos)
        for row, token, done in zip(rows.tolist(), tokens.tolist(), stop.tolist()):
            ended[row] = done
            if not done:
                new[row].append(token)
        going = (~stop).nonzero().flatten()
        if going.numel() == 0 or step + 1 == max_new_tokens:
            break
        if going.numel() < rows.numel():  # drop finished rows from the batch and the cache
            rows, tokens, real, next_pos = rows[going], tokens[going], real[going], next_pos[going]
            cache.keep_rows(going)
        real = torch.cat([real, torch.ones_like(real[:, :1])], dim=1)
        out = target.forward(tokens[:, None], next_pos[:, None], cache, batch_bias(real, 1, target.dtype))
        next_pos = next_pos + 1
    return BatchOutput(token_ids=new, ended=ended)
