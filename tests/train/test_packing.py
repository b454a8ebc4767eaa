"""Packed micro-batches (train.packing): the same loss and gradients as padded rows, no attention
across conversations, and the target's features computed on packed rows equal to stored ones."""

from __future__ import annotations

import random

import pytest
import torch

from eagle.runtime.target import load_target
from eagle import Drafter
from tests.conftest import tiny_target
from tests.train.test_train import save_tiny_chat_target, synthetic_chats
from train import main as trainer
from train.features import FeatureShards, FeaturesConfig, build, collate, compute_features
from train.loss import unroll
from train.packing import block_causal, collate_packed, pack_rows


def test_pack_rows_places_every_example_once_within_the_row_length():
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(300)]
    order = list(range(300))
    rng.shuffle(order)
    rows = pack_rows(lengths, order, 64, open_rows=4)
    assert sorted(i for row in rows for i in row) == list(range(300))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert sum(lengths) / (64 * len(rows)) > 0.85  # rows are nearly full
    assert rows == pack_rows(lengths, order, 64, open_rows=4)
    with pytest.raises(ValueError, match="more than"):
        pack_rows([65], [0], 64)


def test_block_causal_mask_is_causal_within_a_segment_only():
    seg = torch.tensor([[0, 0, 1, 1, 1, 2]])
    allowed = block_causal(seg)[0]
    for q in range(6):
        for k in range(6):
            assert bool(allowed[q, k]) == (k <= q and seg[0, q] == seg[0, k])


def random_examples(target, n: int, seed: int, aux_layers=()) -> list[dict]:
    """``n`` token sequences of 5..12 tokens with a random loss mask, their features from the target."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        length = int(torch.randint(5, 13, (1,), generator=gen))
        ids = torch.randint(1, target.vocab_size, (length,), generator=gen)
        mask = torch.rand(length, generator=gen) < 0.7
        examples.append({"input_ids": ids.tolist(), "loss_mask": mask.int().tolist()})
    feats = compute_features(target, examples, 1 << 20, aux_layers)
    h = target.hidden_size
    return [{"input_ids": torch.tensor(ex["input_ids"]), "loss_mask": torch.tensor(ex["loss_mask"]).bool(),
             "hidden": f[:, :h], **({"aux": f[:, h:]} if aux_layers else {})} for ex, f in zip(examples, feats)]


def loss_and_grads(drafter, target, batch, cfg):
    drafter.zero_grad()
    loss = trainer.step_loss(drafter, drafter, target, batch, cfg, None)
    loss.total.backward()
    return loss, {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_packed_rows_give_the_loss_and_gradients_of_padded_rows(kind):
    target = tiny_target(lean=False, layers=8 if kind == "eagle3" else 2)
    torch.manual_seed(1)  # the drafter's own initialization: its unrolled passes stay of moderate size
    drafter = Drafter.from_target(target, kind=kind).float().train()
    examples = random_examples(target, 5, seed=0, aux_layers=drafter.config.aux_layers)
    cfg = trainer.TrainConfig(noise=0.0, unroll_steps=3, ce_weight=1.0, feature_weight=0.0 if kind == "eagle3" else 1.0)
    padded, grads_padded = loss_and_grads(drafter, target, collate(examples), cfg)
    rows = [[examples[0], examples[3], examples[1]], [examples[4], examples[2]]]
    packed, grads_packed = loss_and_grads(drafter, target, collate_packed(rows), cfg)
    for field in ("total", "smooth_l1", "ce", "top1"):
        torch.testing.assert_close(getattr(packed, field), getattr(padded, field), atol=1e-5, rtol=1e-5)
    assert grads_padded.keys() == grads_packed.keys() and grads_padded
    for name in grads_padded:
        torch.testing.assert_close(grads_packed[name], grads_padded[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_packed_row_does_not_attend_across_conversations(kind):
    """Changing conversation A's features and tokens leaves every unrolled pass's predictions on
    conversation B (after A in the row) as they were; the same row without its segments (one
    causal sequence) does change them: the negative control."""
    target = tiny_target(lean=False, layers=8 if kind == "eagle3" else 2)
    torch.manual_seed(1)
    drafter = Drafter.from_target(target, kind=kind).float()
    a, b = random_examples(target, 2, seed=1, aux_layers=drafter.config.aux_layers)
    other = {**a, "hidden": a["hidden"] + 1.0, "input_ids": (a["input_ids"] + 1) % target.vocab_size}
    if "aux" in a:
        other["aux"] = a["aux"] - 1.0

    def predictions(first: dict, segmented: bool) -> list[torch.Tensor]:
        s = trainer.shift(collate_packed([[first, b]]), target.device, fuse=bool(drafter.config.aux_layers))
        embeds = target.embed(s["tokens"])
        with torch.no_grad():
            preds = unroll(drafter, s["features"], embeds, s["positions"], 3, drafter.config.num_layers,
                           own_hidden=kind == "eagle3", segments=s["segments"] if segmented else None)
        start = len(first["input_ids"])  # B's pairs: from its first token on (its last pair crosses into the tail)
        return [p[0, start:] for p in preds]

    for j, (same, changed) in enumerate(zip(predictions(a, True), predictions(other, True))):
        rooted = slice(j, None)  # B's positions with a root inside B in pass j
        torch.testing.assert_close(same[rooted], changed[rooted], atol=1e-5, rtol=1e-5)
    leaky = [(p - q).abs().max() for p, q in zip(predictions(a, False), predictions(other, False))]
    assert min(leaky) > 1e-3


def test_packed_online_features_equal_stored_features(tmp_path):
    """The trainer's packed micro-batch computed online (one target forward over packed rows) holds
    the features that eagle-features stored for the same conversations, and the same batch."""
    target_dir = save_tiny_chat_target(tmp_path / "target")
    data = synthetic_chats(tmp_path / "chats.jsonl", n=12)
    folder = build(FeaturesConfig(target=str(target_dir), data=str(data), out_dir=str(tmp_path / "features"),
                                  feature_dtype="float32", aux_layers=(0, 1)))
    target = load_target(str(target_dir), lean=False)
    stored = FeatureShards(folder, target)
    online = trainer.online_dataset(target, str(data), 1024, [0, 1])
    rows = pack_rows(trainer.example_lengths(online), list(range(len(online))), 96)
    assert len(rows) < len(online) and max(len(r) for r in rows) > 1
    from_online = trainer.packed_batch(online, rows, target, [0, 1])
    from_stored = trainer.packed_batch(stored, rows, target, [0, 1])
    assert from_online.keys() == from_stored.keys()
    for key in from_online:
        torch.testing.assert_close(from_online[key], from_stored[key].to(from_online[key].dtype), atol=1e-4, rtol=1e-4)


def test_tokenized_sources_are_cached_and_parallel_as_tokenize_all(tmp_path):
    from train.data import load_all, tokenize_all, tokenize_parallel, tokenize_sources

    target = load_target(str(save_tiny_chat_target(tmp_path / "target")), lean=False)
    first, second = synthetic_chats(tmp_path / "a.jsonl", n=30), synthetic_chats(tmp_path / "b.jsonl", n=20, seed=1)
    chats = load_all([str(first), str(second)]).conversations
    want = tokenize_all(target.tokenizer, chats, 24)
    assert tokenize_parallel(target.tokenizer, chats * 20, 24, workers=2) == want * 20
    cache = tmp_path / "cache"
    for _ in range(2):  # computed and stored, then read back
        assert tokenize_sources(target.tokenizer, "fp", [str(first), str(second)], 24, cache) == want
    assert len(list(cache.glob("*.pt"))) == 2
    other = tokenize_sources(target.tokenizer, "fp", str(first), 12, cache)  # another max_length: another key
    assert other == tokenize_all(target.tokenizer, load_all(str(first)).conversations, 12)


@pytest.mark.parametrize("overrides, named", [({"pack_tokens": -1}, "pack_tokens"), ({"pack_tokens": True}, "pack_tokens"),
                                              ({"pack_tokens": 256, "max_length": 512}, "at least max_length"),
                                              ({"pack_tokens": 1024, "student": "draft-lm"}, "draft-lm")])
def test_bad_pack_tokens_are_named(overrides, named):
    from eagle import EagleError

    with pytest.raises(EagleError, match=named):
        trainer.TrainConfig(**overrides)
