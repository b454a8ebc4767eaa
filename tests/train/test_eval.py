"""The trainer's held-out evaluation (``train.main.evaluate``) against a brute-force reference:
drafters that look the next feature up in a table (exactly right, partly wrong, scrambled) give
the top-1 accuracy and the depth-5 chain's accepted length that walking each chain by hand gives."""

from __future__ import annotations

import random

import pytest
import torch

from eagle import Drafter
from train.features import OnlineFeatures, collate
from train.main import evaluate

from tests.conftest import tiny_target


# Features computed in batches of other shapes may round differently (by CPU and kernel), so a table
# finds a feature by its nearest key within TOLERANCE (largest difference of any element), not by its
# bytes: the rounding differences are about 1e-6, the "nearly right" features below differ by about 1e-3.
TOLERANCE = 1e-4


class Table:
    """Features f_t -> the feature a drafter returns for them: ``pairs`` [(key [H], value [H])]; ``get``
    gives the value of the key within TOLERANCE of x, else ``default``."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.keys = torch.stack([k for k, _ in pairs])
        self.values = [v for _, v in pairs]

    def get(self, x: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
        gap, i = (self.keys - x).abs().amax(-1).min(0)
        return self.values[int(i)] if gap <= TOLERANCE else default


class TableDrafter(Drafter):
    """Predicts feature f_{t+1} by looking the input feature up in ``table`` (unknown inputs give
    zeros); attention and token embeddings are ignored."""

    def __init__(self, config, table: Table) -> None:
        super().__init__(config)
        self.table = table

    def forward(self, features, token_embeds, positions, cache=None, attention_bias=None):
        out = torch.zeros(features.shape[:-1] + (self.config.hidden_size,))
        for b in range(features.shape[0]):
            for t in range(features.shape[1]):
                out[b, t] = self.table.get(features[b, t], out[b, t])
        return out


def chat_features(target, n: int = 10, seed: int = 0) -> OnlineFeatures:
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        length = rng.randint(6, 14)
        ids = [rng.randint(1, target.vocab_size - 1) for _ in range(length)]
        mask = [0] * 3 + [rng.random() < 0.8 for _ in range(length - 3)]
        examples.append({"input_ids": ids, "loss_mask": mask})
    return OnlineFeatures(target, examples)


def reference(target, dataset, table, depth: int) -> dict:
    """Walk each chain by hand: from root r (trained when token r+2 is an assistant token) step k
    looks up its input (f_r, then its own previous output) and is right while the target's argmax
    of its output equals that of f_{r+k+1}; the chain stops at the first wrong step or the end."""
    head = target.model.get_output_embeddings()
    hits = roots = accepted = 0
    for i in range(len(dataset)):
        ex = dataset[i]
        h, n = collate([ex])["hidden"][0], len(ex["input_ids"])
        for r in range(n - 2):
            if not ex["loss_mask"][r + 2]:
                continue
            roots += 1
            x, length = h[r], 1
            for k in range(depth):
                q = r + k
                if q + 1 >= n:
                    break
                y = table.get(x, torch.zeros_like(x))
                if head(y).argmax() != head(h[q + 1]).argmax():
                    break
                length, x = length + 1, y
                hits += k == 0
            accepted += length
    return {"top1": hits / roots, "chain5_accept_length": accepted / roots}


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(lean=False)
    dataset = chat_features(target)
    true_next = []  # (f_t, f_{t+1}) of every example, each computed alone
    for i in range(len(dataset)):
        h = collate([dataset[i]])["hidden"][0]
        true_next += [(h[t], h[t + 1]) for t in range(len(h) - 1)]
    return target, dataset, true_next


def drafter_with(target, table) -> TableDrafter:
    return TableDrafter(Drafter.from_target(target).config, table).float()


def test_a_drafter_that_predicts_the_target_features_scores_top1_one_and_the_longest_chains(setup):
    target, dataset, true_next = setup
    table = Table(true_next)
    got = evaluate(drafter_with(target, table), target, dataset, list(range(len(dataset))), 5)
    want = reference(target, dataset, table, 5)
    assert got["top1"] == want["top1"] == 1.0
    assert got["chain5_accept_length"] == pytest.approx(want["chain5_accept_length"], abs=1e-9)
    assert got["chain5_accept_length"] > 4.0  # 6 where the chain fits before the end of the example


@pytest.mark.parametrize("wrong", [0.2, 0.5])
def test_a_partly_wrong_drafter_matches_the_hand_walked_chains(setup, wrong):
    target, dataset, true_next = setup
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    values = [v for _, v in true_next]
    pairs = []
    for k, v in true_next:
        draw = rng.random()
        if draw < wrong:  # another position's feature: mostly the wrong token
            pairs.append((k, values[rng.randrange(len(values))]))
        elif draw < wrong + 0.2:  # nearly the right feature (the right token), but not one it knows what follows
            pairs.append((k, v + 1e-3 * torch.randn(v.shape, generator=gen)))
        else:
            pairs.append((k, v))
    table = Table(pairs)
    got = evaluate(drafter_with(target, table), target, dataset, list(range(len(dataset))), 5)
    want = reference(target, dataset, table, 5)
    assert got == pytest.approx(want, abs=1e-9)
    assert 0.3 < got["top1"] < 0.95 and 1.5 < got["chain5_accept_length"] < 4.5


def test_a_scrambled_drafter_scores_low(setup):
    target, dataset, true_next = setup
    values = [v for _, v in true_next]
    random.Random(2).shuffle(values)
    scrambled = Table([(k, v) for (k, _), v in zip(true_next, values)])
    got = evaluate(drafter_with(target, scrambled), target, dataset, list(range(len(dataset))), 5)
    assert got == pytest.approx(reference(target, dataset, scrambled, 5), abs=1e-9)
    assert got["top1"] < 0.3 and got["chain5_accept_length"] < 1.5
