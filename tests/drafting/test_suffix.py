"""The suffix index against a brute-force scan of the sequences it holds."""

from __future__ import annotations

import random

import numpy as np
import pytest

from eagle.drafting.suffix import SEP, SuffixIndex, continuation_tree


def scan(sequences: list[list[int]], context: list[int], depth: int, max_pattern: int, shortest: int,
         max_occurrences: int) -> tuple[int, dict[tuple[int, ...], int]]:
    """Brute force: every position of every sequence followed by a token; its match with the context's
    suffix, counted backwards; the longest (>= ``shortest``), its newest ``max_occurrences`` occurrences'
    next ``depth`` tokens counted per prefix -> (match, {path: count})."""
    pattern = context[-max_pattern:][::-1]
    found = []  # (match, order, position in sequence, sequence)
    order = 0
    for seq in sequences:
        for p in range(len(seq) - 1):
            n = 0
            while n < len(pattern) and p - n >= 0 and seq[p - n] == pattern[n]:
                n += 1
            found.append((n, order, p, seq))
            order += 1
    best = max((f[0] for f in found), default=0)
    if best < shortest:
        return 0, {}
    chosen = sorted((f for f in found if f[0] == best), key=lambda f: -f[1])[:max_occurrences]
    counts: dict[tuple[int, ...], int] = {}
    for _, _, p, seq in chosen:
        after = seq[p + 1:p + 1 + depth]
        for j in range(1, len(after) + 1):
            counts[tuple(after[:j])] = counts.get(tuple(after[:j]), 0) + 1
    return best, counts


def paths(tree) -> dict[tuple[int, ...], int]:
    out, path_of = {}, {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        path_of[i] = (path_of[parent] if parent >= 0 else ()) + (token,)
        out[path_of[i]] = tree.counts[i]
    return out


def held(sequences: list[list[int]], capacity: int) -> list[list[int]]:
    """The newest sequences that fit in ``capacity`` positions, each with its separator."""
    kept, used = [], 0
    for seq in reversed(sequences):
        if used + len(seq) + 1 > capacity:
            break
        kept.insert(0, seq)
        used += len(seq) + 1
    return kept


@pytest.mark.parametrize("seed", range(6))
def test_lookup_matches_a_scan(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])
    base = [rng.randrange(vocab) for _ in range(40)]
    sequences = []
    for _ in range(rng.randrange(3, 12)):  # repeated material with edits, as real workloads repeat
        seq = base[rng.randrange(10):rng.randrange(20, 40)]
        seq = [t if rng.random() > 0.1 else rng.randrange(vocab) for t in seq]
        sequences.append(seq)
    capacity = rng.choice([60, 150, 10_000])
    index = SuffixIndex(capacity, max_pattern=12, gram_lengths=(2, 5), max_walk=10 ** 6, max_occurrences=7)
    for seq in sequences:
        index.add(seq)
    kept = held(sequences, capacity)
    for _ in range(30):
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))] + base[:rng.randrange(1, 30)]
        tree = index.lookup(context, depth=6)
        match, counts = scan(kept, context, 6, 12, 2, 7)
        assert (tree.match, paths(tree)) == (match, counts)
        if match:
            assert tree.occurrences == counts_at_root(counts)


def counts_at_root(counts):
    return sum(c for path, c in counts.items() if len(path) == 1)


def test_open_sequence_is_searched_without_its_own_end():
    """The current request: the context itself is in the index; its last token has no continuation yet."""
    index = SuffixIndex(1000, gram_lengths=(2,))
    index.extend([1, 2, 3, 4, 1, 2])
    tree = index.lookup([1, 2, 3, 4, 1, 2], depth=3)
    assert tree.match == 2 and paths(tree) == {(3,): 1, (3, 4): 1, (3, 4, 1): 1}
    index.extend([3])
    tree = index.lookup([1, 2, 3, 4, 1, 2, 3], depth=2)
    assert tree.match == 3 and paths(tree) == {(4,): 1, (4, 1): 1}


def test_eviction_keeps_the_newest_whole_sequences():
    index = SuffixIndex(10, gram_lengths=(2,))
    index.add([1, 2, 3, 4])
    index.add([5, 6, 7])
    assert index.lookup([1, 2], depth=2).match == 2
    index.add([8, 9, 1])  # 5 + 4 + 4 > 10: the first sequence goes
    assert index.lookup([1, 2], depth=2).match == 0
    assert index.lookup([5, 6], depth=2).match == 2
    assert index.tokens <= 10


def test_min_token_prob_and_limit():
    rows = np.array([[1, 2], [1, 2], [1, 3], [4, SEP]] + [[1, 2]] * 6)
    tree = continuation_tree(rows, min_token_prob=0.15)
    assert paths(tree) == {(1,): 9, (1, 2): 8}  # 4 is seen 1 of 10 times, 3 once of 9
    assert len(continuation_tree(rows, limit=2).tokens) == 2


def test_factor_bounds_depth():
    index = SuffixIndex(100, gram_lengths=(2,))
    index.add(list(range(20)))
    tree = index.lookup([7, 3, 4], depth=10, max_spec_factor=1.5)
    assert tree.match == 2 and max(len(p) for p in paths(tree)) == 3


def test_add_separated_equals_add():
    rng = random.Random(3)
    sequences = [[rng.randrange(4) for _ in range(rng.randrange(1, 15))] for _ in range(12)]
    one, many = SuffixIndex(80, gram_lengths=(2, 5)), SuffixIndex(80, gram_lengths=(2, 5))
    for seq in sequences:
        one.add(seq)
    many.add_separated(np.array([t for seq in sequences for t in seq + [SEP]]))
    for _ in range(20):
        context = [rng.randrange(4) for _ in range(6)]
        a, b = one.lookup(context, 4), many.lookup(context, 4)
        assert (a.match, paths(a)) == (b.match, paths(b))
