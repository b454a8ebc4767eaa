import pytest
import torch

from eagle.decoding import acceptance
from eagle.decoding.tree_mask import tree_attention


def test_residual_distribution():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.2, 0.1])
    r = acceptance.residual_distribution(p, q)
    assert torch.allclose(r, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    q2 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    assert torch.allclose(acceptance.residual_distribution(p, q2), torch.tensor([0.25, 0.05, 0.0, 0.0]) / 0.30)
    assert torch.allclose(acceptance.residual_distribution(p, p), p)  # nothing to correct: p itself
    batch = acceptance.residual_distribution(torch.stack([p, p]), torch.stack([q, q2]))
    assert torch.allclose(batch.sum(-1), torch.ones(2))


def brute_force_greedy(tokens, parents, argmax):
    best = [0]
    for leaf in range(len(tokens)):
        path, j = [], leaf
        while j != -1:
            path.append(j)
            j = parents[j]
        path = path[::-1]
        kept = [0]
        for node in path[1:]:
            if tokens[node] != argmax[kept[-1]]:
                break
            kept.append(node)
        if len(kept) > len(best):
            best = kept
    return best, argmax[best[-1]]


def test_greedy_tree_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = 1 + trial % 15
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tokens = torch.randint(0, 3, (n,), generator=gen)
        argmax = torch.randint(0, 3, (n,), generator=gen)
        attn = tree_attention(torch.tensor(parents))
        acc = acceptance.greedy_tree(tokens, torch.tensor(parents), attn.paths, argmax)
        nodes, _ = brute_force_greedy(tokens.tolist(), parents, argmax.tolist())
        got = acc.nodes.tolist()
        assert len(got) == len(nodes)  # longest agreeing path (ties may pick another path of that length)
        assert got[0] == 0 and all(parents[b] == a and tokens[b] == argmax[a] for a, b in zip(got, got[1:]))
        assert acc.next_token == int(argmax[got[-1]])


def _first_token_frequencies(rule, vocab, n, seed):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(vocab)
    for _ in range(n):
        counts[rule(gen)] += 1
    return counts / n


def test_recursive_rejection_is_exact_for_one_level():
    p = torch.tensor([0.1, 0.4, 0.2, 0.3])
    tokens, parents = torch.tensor([9, 1, 3, 0]), torch.tensor([-1, 0, 0, 0])
    probs = torch.stack([p, p, p, p])

    def first(gen):
        acc = acceptance.recursive_rejection_tree(tokens, parents, probs, gen)
        return int(tokens[acc.nodes[1]]) if len(acc.nodes) > 1 else acc.next_token

    freq = _first_token_frequencies(first, 4, 20000, 0)
    assert (freq - p).abs().sum() / 2 < 0.015

    tokens = torch.tensor([9, 1, 1, 3])  # a token twice among the children (a lookup graft can repeat one)
    freq = _first_token_frequencies(first, 4, 20000, 1)
    assert (freq - p).abs().sum() / 2 < 0.015


def test_speculative_chain_is_exact_for_one_step_and_lenience_is_not():
    p = torch.tensor([[0.1, 0.6, 0.3], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.6, 0.2, 0.2]])

    def first(lenience):
        def draw(gen):
            x = torch.multinomial(q[0], 1, generator=gen)
            acc = acceptance.speculative_chain(x, q, p, gen, lenience=lenience)
            return int(x[0]) if len(acc.nodes) > 1 else acc.next_token
        return draw

    exact = _first_token_frequencies(first(1.0), 3, 20000, 1)
    assert (exact - p[0]).abs().sum() / 2 < 0.015
    lossy = _first_token_frequencies(first(0.3), 3, 20000, 1)
    assert (lossy - p[0]).abs().sum() / 2 > 0.1


def test_sampled_tree_rule_is_exact_for_one_level_and_needs_the_real_draft_distribution():
    """Children drawn without replacement from q (``drawn_children``), tried by recursive
    speculative decoding: the first token follows p exactly, for 1-3 children and a q far from p.
    Teeth: drafts drawn from another distribution than the q the rule is given come out wrong.
    What the rule is for: it accepts a drawn child far more often than the deterministic-draft
    rule (also exact for any drafts chosen without the target: sum min(p, q) = 0.5 against
    sum q p = 0.15 for one child here)."""
    from eagle.decoding.tree import drawn_children

    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    q = torch.tensor([0.05, 0.15, 0.3, 0.3, 0.2])
    probs = torch.stack([p] * 4)

    def first(k, drawn_from, rule="sampled"):
        def draw(gen):
            tokens = drawn_children(torch.zeros(1), drawn_from.log()[None], k, 1.0, drawn_from.numel(),
                                    torch.rand(1, drawn_from.numel(), generator=gen))[0][0]
            tree_tokens, parents = torch.cat([torch.tensor([9]), tokens]), torch.tensor([-1] + [0] * k)
            if rule == "sampled":
                child_probs = torch.zeros(k + 1, 5)
                child_probs[0] = q
                acc = acceptance.recursive_rejection_tree(tree_tokens, parents, probs[:k + 1], gen, child_probs,
                                                          parents >= 0)
            else:
                acc = acceptance.recursive_rejection_tree(tree_tokens, parents, probs[:k + 1], gen)
            accepted.append(len(acc.nodes) > 1)
            return int(tree_tokens[acc.nodes[1]]) if len(acc.nodes) > 1 else acc.next_token
        return draw

    accepted: list[bool] = []

    for k in (2, 3):  # one child: below
        freq = _first_token_frequencies(first(k, q), 5, 20000, k)
        assert (freq - p).abs().sum() / 2 < 0.015
    # q all but on one token: after it is rejected, the next draw's q is a renormalized ~1e-17 (a
    # rule that renormalized by 1 - q(x) kept it unnormalized once q(x) rounded to 1 in float32)
    q = torch.tensor([1e-30, 5e-17, 1.0, 1e-25, 1e-33])
    freq = _first_token_frequencies(first(2, q), 5, 20000, 4)
    assert (freq - p).abs().sum() / 2 < 0.015
    q = torch.tensor([0.05, 0.15, 0.3, 0.3, 0.2])
    other = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])  # what the drafts really came from
    assert (_first_token_frequencies(first(2, other), 5, 20000, 7) - p).abs().sum() / 2 > 0.05
    for rule, rate in (("sampled", 0.5), ("deterministic", 0.15)):
        accepted.clear()
        assert (_first_token_frequencies(first(1, q, rule=rule), 5, 20000, 8) - p).abs().sum() / 2 < 0.015
        assert abs(sum(accepted) / len(accepted) - rate) < 0.015


@pytest.mark.parametrize("deterministic", [[3], [2, 0], [1, 0]])
def test_tree_rule_with_deterministic_drafts_after_drawn_siblings_is_exact(deterministic):
    """Two children drawn from q without replacement, then deterministic drafts (prompt-lookup
    grafts, tried after their drawn siblings; their token is often one already drawn and
    rejected): the first token follows p exactly. Teeth: judging a deterministic draft as if it
    were the next draw from q (ratio r / q_i) is not exact."""
    from eagle.decoding.tree import drawn_children

    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    q = torch.tensor([0.05, 0.15, 0.3, 0.3, 0.2])
    n = 3 + len(deterministic)
    parents = torch.tensor([-1] + [0] * (n - 1))
    child_probs = torch.zeros(n, 5)
    child_probs[0] = q

    def first(drawn):
        def draw(gen):
            tokens = drawn_children(torch.zeros(1), q.log()[None], 2, 1.0, q.numel(),
                                    torch.rand(1, q.numel(), generator=gen))[0][0]
            tree_tokens = torch.cat([torch.tensor([9]), tokens, torch.tensor(deterministic)])
            acc = acceptance.recursive_rejection_tree(tree_tokens, parents, torch.stack([p] * n), gen, child_probs, drawn)
            return int(tree_tokens[acc.nodes[1]]) if len(acc.nodes) > 1 else acc.next_token
        return draw

    drawn = torch.tensor([False, True, True] + [False] * len(deterministic))
    assert (_first_token_frequencies(first(drawn), 5, 20000, 3) - p).abs().sum() / 2 < 0.015
    if deterministic == [1, 0]:  # (with the others the wrong rule errs by less than a test can tell quickly)
        assert (_first_token_frequencies(first(parents >= 0), 5, 20000, 3) - p).abs().sum() / 2 > 0.05
