"""Pooled caches (``kv_cache.CachePool``, ``SlotCache``) and the forward that attends for all their
sequences in one call per layer (``pooled.pooled_forward``): against each sequence's own cache and
forward, on tiny random Llama, Qwen3 and Gemma-3 targets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle import EagleError
from eagle.decoding.tree_mask import tree_attention
from eagle.runtime.masks import attention_bias
from eagle.runtime.kv_cache import CachePool, StaticCache
from eagle.runtime.pooled import pooled_forward
from eagle.runtime.segments import segment_forward

from tests.conftest import test_device as device_under_test, tiny_gemma, tiny_target

TARGETS = {"llama": lambda: tiny_target(eos=True, seed=10), "qwen3": lambda: tiny_target(seed=4, family="qwen3"),
           "gemma": lambda: tiny_gemma(seed=3, window=6)}


def pool_for(target, slots: int) -> CachePool:
    lean = target.lean
    return CachePool(len(lean.layers), slots, lean.num_kv_heads, lean.head_dim, target.dtype, target.device)


def filled(cache: StaticCache, lengths: int, seed: int) -> StaticCache:
    """``cache`` with ``lengths`` random positions written in each of its layers (2 kv heads of 4)."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(len(cache.lengths)):
        cache.update(i, *(torch.randn(1, 2, lengths, 4, generator=gen).to(device_under_test()) for _ in range(2)))
    return cache


def assert_same_entries(mine: StaticCache, ref: StaticCache, exact: bool = True) -> None:
    assert mine.lengths == ref.lengths
    n = ref.lengths[0]
    for a, b in zip(mine.keys + mine.values, ref.keys + ref.values):
        if exact:
            assert torch.equal(a[..., :n, :], b[..., :n, :])
        else:
            torch.testing.assert_close(a[..., :n, :], b[..., :n, :], rtol=1e-4, atol=1e-4)


def test_slot_caches_compact_and_grow_as_static_caches_do():
    """Compactions are deferred to the pool and applied together (two in a row on one slot in order; one
    that moves nothing is not queued);
    growing past the capacity keeps every slot's entries; a released slot is the next one handed out;
    a full pool refuses."""
    pool = CachePool(3, 3, 2, 4, torch.float32, device_under_test(), capacity=8)
    mine = [filled(pool.cache(), 6, seed) for seed in range(3)]
    refs = [filled(StaticCache(3), 6, seed) for seed in range(3)]
    assert [c.slot for c in mine] == [0, 1, 2] and pool.top == 3
    with pytest.raises(EagleError, match="slots"):
        pool.cache()
    keep = torch.tensor([3, 5], device=device_under_test())
    for cache in (mine[0], refs[0], mine[2], refs[2]):
        cache.compact(2, keep)
    for cache in (mine[2], refs[2]):  # a second move on slot 2 reads what the first wrote
        cache.compact(1, torch.tensor([2, 3], device=device_under_test()))
    moves = len(pool._moves)
    for cache in (mine[1], refs[1]):  # a round that kept its root alone (host positions): nothing to move
        cache.compact(5, torch.tensor([5]))
    assert len(pool._moves) == moves
    for a, b in zip(mine, refs):
        assert_same_entries(a, b)
    for i in range(3):  # slot 1 outgrows the capacity: every slot keeps its entries
        for cache in (mine[1], refs[1]):
            cache.update(i, *(torch.full((1, 2, 5, 4), float(i), device=device_under_test()) for _ in range(2)))
    assert pool.capacity == 16
    for a, b in zip(mine, refs):
        assert_same_entries(a, b)
    pool.release(mine[1])
    assert pool.top == 3 and pool.cache().slot == 1
    with pytest.raises(EagleError):
        mine[0].keep_rows(torch.tensor([0]))


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_pooled_forward_equals_each_sequence_alone(family, monkeypatch):
    """Four prompts prefilled in one pooled forward, then three of them (out of slot order, slot 1 left
    out) verify a tree deeper than Gemma's window of 6, a single row and a chain past it in one forward: each row's
    features (final norm and an unsorted pair of layer outputs) equal its own sequence's forward, each
    cache holds what its own forward wrote, the sequence left out is untouched, and each forward made
    one attention call per layer. Then the one left out runs alone (its slot gathered from the pool)."""
    target = TARGETS[family]()
    lean = target.lean
    contexts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 2, 2], [2, 8, 8, 8, 1], [7, 7, 1, 2, 3, 4, 5]]
    pool = pool_for(target, 4)
    caches = [pool.cache() for _ in contexts]
    refs = [lean.new_cache() for _ in contexts]
    aux = (1, 0)
    calls = []
    attention = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or attention(*a, **kw))
    out = pooled_forward(lean, torch.tensor(sum(contexts, []), device=target.device),
                         torch.cat([torch.arange(len(c)) for c in contexts]).to(target.device), caches,
                         [len(c) for c in contexts], [None] * 4, aux)
    assert len(calls) == len(lean.layers)
    monkeypatch.setattr(F, "scaled_dot_product_attention", attention)
    alone = [target.forward(torch.tensor([c], device=target.device), torch.arange(len(c), device=target.device)[None],
                            ref, aux_layers=aux).features[0] for c, ref in zip(contexts, refs)]
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-4, atol=1e-4)
    untouched = [t[..., :3, :].clone() for t in caches[1].keys + caches[1].values]

    order = [3, 0, 2]
    # a tree deeper than Gemma's window whose rows sit further from their ancestors than their depths do
    parents = {3: torch.tensor([-1, 0, 0, 0, 3, 4, 5, 6, 7, 8, 1]), 0: torch.tensor([-1]), 2: torch.arange(-1, 8)}
    tokens, positions, masks, alone = [], [], [], []
    for s in order:
        attn = tree_attention(parents[s])
        past = len(contexts[s])
        tok = (torch.arange(5, 5 + len(parents[s])) % 32).to(target.device)
        bias = attention_bias(attn.mask, past, target.dtype) if len(parents[s]) > 1 else None
        alone.append(target.forward(tok[None], (past + attn.depths)[None], refs[s], bias,
                                    aux_layers=aux).features[0])
        tokens.append(tok)
        positions.append(past + attn.depths)
        masks.append(bias)
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or attention(*a, **kw))
    calls.clear()
    out = segment_forward(lean, torch.cat(tokens), torch.cat(positions), [caches[s] for s in order],
                          [len(parents[s]) for s in order], masks, aux)
    assert len(calls) == len(lean.layers)
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-4, atol=1e-4)
    for s in order:
        assert_same_entries(caches[s], refs[s], exact=False)
    assert caches[1].lengths == [3] * len(lean.layers)
    assert all(torch.equal(a[..., :3, :], b) for a, b in zip(caches[1].keys + caches[1].values, untouched))

    tok = torch.tensor([4, 5, 6], device=target.device)
    want = target.forward(tok[None], torch.arange(3, 6, device=target.device)[None], refs[1], aux_layers=aux)
    got = pooled_forward(lean, tok, torch.arange(3, 6, device=target.device), [caches[1]], [3], [None], aux)
    torch.testing.assert_close(got, want.features[0], rtol=1e-4, atol=1e-4)
    assert_same_entries(caches[1], refs[1], exact=False)
