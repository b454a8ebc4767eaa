"""Logits -> probabilities, the same warping for every method (temperature, top-k, top-p)."""

from __future__ import annotations

import torch

from eagle.config import SamplingConfig


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Warp logits [..., V] into the distribution tokens are drawn from, [..., V] float32.

    Temperature 0 gives a one-hot of the argmax (greedy). Order as in Hugging Face:
    temperature, then top-k, then top-p (the smallest set whose mass reaches top_p)."""
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if 0 < cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= cfg.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of ``probs`` [..., V] (non-negative, not necessarily normalized)
    -> [...] (long), by inverting the cumulative distribution at a uniform draw (in float64):
    token i is drawn when cdf[i - 1] <= u < cdf[i], so a zero-probability token never is. On CPU
    this is much faster than ``torch.multinomial`` over a large vocabulary."""
    flat = probs.reshape(-1, probs.shape[-1])
    if generator is not None and generator.device != flat.device:
        flat = flat.to(generator.device)
    u = torch.rand(flat.shape[0], generator=generator, dtype=torch.float64, device=flat.device)
    return invert_cdf(flat, u).reshape(probs.shape[:-1]).to(probs.device)


def invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``sample`` with its uniform draws given: ``probs`` [..., V] (non-negative, not necessarily
    normalized), ``uniform`` [...] in [0, 1) -> [...] long, token i where cdf[i - 1] <= u * total <
    cdf[i] (fixed shapes, no host read: usable inside a captured function)."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    u = uniform.to(torch.float64)[..., None] * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).clamp(max=probs.shape[-1] - 1)[..., 0]


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for every random draw of one generation (seeded = reproducible)."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
