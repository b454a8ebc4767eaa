"""Suffix drafts (method ``suffix``, and grafted onto EAGLE trees): greedy output equals plain
decoding; drafts come from the request, earlier outputs and a corpus; accepted tokens by source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle import EagleModel
from eagle.config import SuffixConfig
from eagle.decoding.tree import Pool, graft_tree, kept_indices
from eagle.drafting.suffix import SuffixStore, corpus_files, new_index, read_corpus
from eagle.errors import EagleError

from tests.conftest import prompts, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def model():
    target = tiny_target(vocab_size=32)
    draft = tiny_target(vocab_size=32, seed=9)
    return EagleModel.from_pretrained(target, drafter=tiny_drafter(target), draft_model=draft.model, total_tokens=8,
                                      depth=3, top_k=2)


def test_graft_tree_shares_and_keeps_a_subtree():
    pool = Pool([5, 1, 2], [-1, 0, 0], [0.0, -0.5, -1.0])
    out, places = graft_tree(pool, 0, [1, 7, 8, 2], [-1, 0, 1, -1], [-0.1, -0.2, -3.0, -2.0])
    assert places == [1, 3, 4, 2]
    assert out.scores[1] == pytest.approx(-0.1) and out.scores[2] == pytest.approx(-1.0)  # raised; kept the higher
    assert out.parents[3:] == [1, 3]
    kept = kept_indices(out.scores, 4)
    assert all(out.parents[n] in kept for n in kept[1:])
    new, places = graft_tree(pool, 0, [1], [-1], [-0.1], share_from=pool.size)
    assert places == [3] and new.scores[1] == -0.5  # a drawn sibling is never merged


@pytest.mark.parametrize("method", ["suffix", "eagle-tree", "sd"])
def test_greedy_equals_ar_and_repeats_are_drafted(model, method):
    view = model.with_suffix(SuffixStore(SuffixConfig()))
    runs = prompts(3, seed=4) * 2  # each prompt again: its output is in the history the second time
    ids = {}
    for i, prompt in enumerate(runs):
        ar = model.generate(prompt, method="ar", max_new_tokens=24).token_ids
        out = view.generate(prompt, method=method, max_new_tokens=24)
        assert out.token_ids == ar
        ids[i] = out
    again = [ids[i] for i in range(3, 6)]
    assert sum(r.accepted_by_source.get("history", 0) for r in again) > 0
    assert all(r.target_forwards < 24 for r in again)
    if method != "suffix":
        assert any(r.accepted_by_source.get("drafter", 0) for r in ids.values())


def test_corpus_drafts(model):
    """A corpus holding what the target answers: its continuations are drafted and accepted."""
    prompt = [3, 7, 8, 9, 10]
    answer = model.generate(prompt, method="ar", max_new_tokens=16).token_ids
    store = SuffixStore(SuffixConfig())
    store.corpus = new_index(100, store.cfg)
    store.corpus.add([5, 9, 10] + answer + [4])
    got = model.with_suffix(store).generate(prompt, method="suffix", max_new_tokens=16)
    assert got.token_ids == answer
    assert got.accepted_by_source.get("corpus", 0) >= 8 and got.target_forwards <= 8


class WordTokenizer:
    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[len(w) for w in t.split()] for t in texts]}


def test_corpus_files_are_read_once_skipping_what_is_not_text(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("aa bbb c dddd\n")
    (root / "sub" / "b.txt").write_text("x yy zzz\n")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02")
    (root / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    locked = root / "locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    files = corpus_files(str(root))
    readable = 1 if locked.stat().st_mode and _can_read(locked) else 0
    assert files.skipped == {"unreadable": 1 - readable, "binary": 2}
    index, stats = read_corpus(str(root), WordTokenizer(), "words", SuffixConfig())
    assert stats["cached"] is False and stats["files"] == 2 + readable
    assert index.lookup([2, 3], depth=3).tokens == [1, 4]
    _, again = read_corpus(str(root), WordTokenizer(), "words", SuffixConfig())
    assert again["cached"] is True


def _can_read(path) -> bool:
    try:
        path.read_bytes()
        return True
    except OSError:
        return False


def test_corpus_over_the_bound_is_refused_before_tokenizing(tmp_path):
    (tmp_path / "big.txt").write_text("word " * 100)

    class Refuses:
        def __call__(self, *a, **k):
            raise AssertionError("tokenized")

    with pytest.raises(EagleError, match="over the corpus bound of 100 tokens") as err:
        read_corpus(str(tmp_path), Refuses(), "x", SuffixConfig(corpus_tokens=100))
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def six():
    from tests.decoding.test_losslessness import VOCAB

    target = tiny_target(vocab_size=VOCAB, hidden=16, layers=1, init_std=0.5)
    return EagleModel.from_pretrained(target, drafter=tiny_drafter(target), total_tokens=6, depth=3, top_k=2)


def sampled_with_sources(model, method, sampling, n, prompt):
    """``sampled_triples`` and the accepted drafts by source over the n generations."""
    from tests.decoding.test_losslessness import VOCAB

    counts, sources = torch.zeros(VOCAB, VOCAB, VOCAB), {}
    for seed in range(n):
        out = model.generate(prompt, method=method, max_new_tokens=3, temperature=sampling.temperature, seed=seed)
        counts[tuple(out.token_ids)] += 1
        for k, v in out.accepted_by_source.items():
            sources[k] = sources.get(k, 0) + v
    return counts, sources


@pytest.mark.slow
def test_suffix_sampling_is_lossless_and_the_check_has_teeth(six, monkeypatch):
    """Method ``suffix`` at temperature 1: drafts from the prompt and from the earlier generations'
    outputs, judged as point masses. The control (a draft accepted with sqrt(p)) must be rejected."""
    from eagle.config import SamplingConfig
    from eagle.decoding import acceptance
    from tests.decoding.test_losslessness import ALPHA, SAMPLES, chi_square_p, exact_triples, over_accepting

    sampling, prompt = SamplingConfig(temperature=1.0), [1, 2, 3, 1, 2]
    exact = exact_triples(six, sampling, prompt)
    counts, sources = sampled_with_sources(six.with_suffix(SuffixStore(SuffixConfig())), "suffix", sampling,
                                           SAMPLES, prompt)
    assert sources.get("request", 0) > 100 and sources.get("history", 0) > 100
    assert chi_square_p(counts, exact) > ALPHA
    monkeypatch.setattr(acceptance, "recursive_rejection_tree", over_accepting)
    counts, _ = sampled_with_sources(six.with_suffix(SuffixStore(SuffixConfig())), "suffix", sampling,
                                     SAMPLES // 2, prompt)
    assert chi_square_p(counts, exact) < ALPHA


@pytest.mark.slow
def test_suffix_drafts_beside_drawn_nodes_are_lossless(six, monkeypatch):
    """Suffix drafts grafted onto a sampled tree (children drawn from a spread-out drafter), after the
    drawn nodes, never merged with them; the same control must be rejected."""
    import dataclasses

    from eagle.config import SamplingConfig
    from eagle.decoding import acceptance
    from eagle.drafting.drafter import Drafter
    from tests.decoding.test_losslessness import ALPHA, SAMPLES, chi_square_p, exact_triples, over_accepting

    torch.manual_seed(1)
    spread = Drafter.from_target(six.target).eval()
    sampling, prompt = SamplingConfig(temperature=1.0), [1, 2, 3, 1, 2]
    tree = dataclasses.replace(six.tree, lookup_tokens=0)

    def mixed():
        return EagleModel(six.target, spread, tree=tree, suffix=SuffixStore(SuffixConfig()), suffix_grafts=True)

    exact = exact_triples(six, sampling, prompt)
    counts, sources = sampled_with_sources(mixed(), "eagle-tree", sampling, SAMPLES, prompt)
    assert sources.get("drafter", 0) > 100 and sources.get("request", 0) + sources.get("history", 0) > 100
    assert chi_square_p(counts, exact) > ALPHA
    monkeypatch.setattr(acceptance, "recursive_rejection_tree", over_accepting)
    counts, _ = sampled_with_sources(mixed(), "eagle-tree", sampling, SAMPLES // 2, prompt)
    assert chi_square_p(counts, exact) < ALPHA


@pytest.fixture(scope="module")
def six_sd():
    from tests.decoding.test_losslessness import VOCAB

    target = tiny_target(vocab_size=VOCAB, hidden=16, layers=1, init_std=0.5)
    draft = tiny_target(vocab_size=VOCAB, hidden=16, layers=1, init_std=0.5, seed=9)
    return EagleModel.from_pretrained(target, draft_model=draft.model, gamma=2)


@pytest.mark.slow
def test_suffix_drafts_in_sd_chains_are_lossless_and_the_check_has_teeth(six_sd, monkeypatch):
    """``sd`` chains that start with suffix tokens (point masses) where those are more likely right
    than the draft model's guess, the draft model's draws after them (judged by their q): the output
    follows the target's distribution. The control (point masses and draws alike accepted with
    sqrt(p)) must be rejected."""
    from eagle.config import SamplingConfig
    from eagle.decoding import acceptance
    from tests.decoding.test_losslessness import ALPHA, SAMPLES, chi_square_p, exact_triples, over_accepting

    sampling, prompt = SamplingConfig(temperature=1.0), [1, 2, 3, 1, 2]
    exact = exact_triples(six_sd, sampling, prompt)
    counts, sources = sampled_with_sources(six_sd.with_suffix(SuffixStore(SuffixConfig())), "sd", sampling,
                                           SAMPLES, prompt)
    assert sources.get("drafter", 0) > 100 and sources.get("request", 0) + sources.get("history", 0) > 100
    assert chi_square_p(counts, exact) > ALPHA
    monkeypatch.setattr(acceptance, "recursive_rejection_tree", over_accepting)
    counts, _ = sampled_with_sources(six_sd.with_suffix(SuffixStore(SuffixConfig())), "sd", sampling,
                                     SAMPLES // 2, prompt)
    assert chi_square_p(counts, exact) < ALPHA


def test_accepted_drafts_count_for_the_source_that_scored_them_higher(model):
    """A pool of drafter nodes, prompt-lookup chains and suffix drafts from the request and from
    earlier answers: each node is labelled by the source whose score it kept (by hand below: the
    lookup chain raises the drafter's deep path 8 9 5 6, the request's continuation 8 9 5 raises
    it further up to its depth, earlier answers add 30 31), and accepted drafts count so."""
    from eagle.config import SamplingConfig
    from eagle.decoding.sampling import make_generator

    store = SuffixStore(SuffixConfig())
    store.history.add([9, 5, 6, 7, 30, 31])
    drafter = model.with_suffix(store)._proposer("eagle-tree", SamplingConfig(), make_generator(0))
    ids = [5, 6, 7, 8, 9, 5, 6]
    drafter.suffix.start(ids)
    pool = Pool([6, 7, 3, 8, 9, 5, 6], [-1, 0, 0, 1, 3, 4, 5], [0.0, -0.1, -1.0, -3.0, -3.1, -3.2, -3.3])
    pool = drafter.graft_suffix(ids, drafter.graft_lookup(ids, pool, 16), 7, 16)
    labels = dict(zip(range(pool.size), drafter.suffix.labels))
    assert [labels[n] for n in range(7)] == ["", "drafter", "drafter", "request", "request", "request", "lookup"]
    assert [labels[n] for n in range(pool.size) if pool.parents[n] == 1 and pool.tokens[n] == 30] == ["history"]
    drafter.suffix.commit(ids + [7, 8, 9, 5, 6, 11], [1, 3, 4, 5, 6], list(range(pool.size)))
    assert drafter.accepted_by_source() == {"drafter": 1, "request": 3, "lookup": 1}


@pytest.mark.parametrize("method", ["suffix", "eagle-tree", "sd"])
def test_every_accepted_draft_counts_once(model, method):
    """Accepted drafts by source add up to the drafts the target kept (the last round's counted at the
    end, as many as its tokens when the length cut its bonus token off); the first answer has no
    earlier ones to draft from."""
    view = model.with_suffix(SuffixStore(SuffixConfig()))
    for i, prompt in enumerate(prompts(4, seed=5) * 2):
        out = view.generate(prompt, method=method, max_new_tokens=20)
        kept = sum(n - 1 for n in out.accept_lengths)
        assert kept <= sum(out.accepted_by_source.values()) <= kept + 1
        assert i or not out.accepted_by_source.get("history")
