"""Sampling is lossless: the first 3 generated tokens follow the target's exact distribution.

The exact distribution is enumerated from the tiny target (vocabulary 6: 216 triples); 2000
seeded generations are compared with a chi-square test. Each check also runs a negative
control (a deliberately broken acceptance rule) that the same test must reject, on half or a
quarter as many: every control fails with p below 1e-7 at that size (docs/device-sampling.md), so
the 20k samples these checks once drew (a tenth of CI's slow tests' time) bought no power they need."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from scipy.stats import chisquare

from eagle import EagleModel
from eagle.decoding import acceptance
from eagle.config import SamplingConfig
from eagle.drafting.drafter import Drafter
from eagle.decoding.sampling import logits_to_probs, sample

from tests.conftest import tiny_drafter, tiny_target

VOCAB, PROMPT, SAMPLES, ALPHA = 6, [1, 2, 3], 2000, 1e-3
DEVICE_SAMPLES = 1000  # device rounds' checks (see their test)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
    target = tiny_target(vocab_size=VOCAB, hidden=16, layers=1, init_std=0.5)
    draft = tiny_target(vocab_size=VOCAB, hidden=16, layers=1, init_std=0.5, seed=9)
    return EagleModel.from_pretrained(target, drafter=tiny_drafter(target), draft_model=draft.model,
                                      total_tokens=6, depth=3, top_k=2, gamma=2)


@pytest.fixture(scope="module")
def spread(model):
    """A drafter whose distributions are spread out (unscaled random weights). ``tiny_drafter``'s
    are all but point masses on this target (root: 0.69 / 0.31 over two tokens, below it one
    token), which hides some errors in how drawn children are judged: told the wrong draw
    temperature, its tree still passed the chi-square check (p = 0.32); with this one it fails
    (p = 0). (The rejected-draws-kept-in-q control is the other way round: see below.)"""
    torch.manual_seed(1)
    return Drafter.from_target(model.target).eval()


def exact_triples(model: EagleModel, sampling: SamplingConfig, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) [V, V, V] by enumerating every 2-token continuation."""
    pairs = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))
    ids = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], dim=1).to(model.target.device)
    with torch.no_grad():
        logits = model.target.model(ids).logits[:, len(prompt) - 1:].cpu()
    probs = logits_to_probs(logits, sampling)  # [V*V, 3, V]
    p1 = probs[0, 0]
    p2 = probs[:, 1].reshape(VOCAB, VOCAB, VOCAB)[:, 0]  # [x1, x2]
    p3 = probs[:, 2].reshape(VOCAB, VOCAB, VOCAB)  # [x1, x2, x3]
    return p1[:, None, None] * p2[:, :, None] * p3


def sampled_triples(model: EagleModel, method: str, sampling: SamplingConfig, n: int,
                    prompt: list[int] = PROMPT) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for seed in range(n):
        out = model.generate(prompt, method=method, max_new_tokens=3, temperature=sampling.temperature,
                             top_p=sampling.top_p, seed=seed)
        counts[tuple(out.token_ids)] += 1
    return counts


def chi_square_p(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """Goodness of fit; cells expected below 5 are pooled into one. A sample of a triple the
    target gives probability 0 (outside the top-p nucleus, say) fails outright (p = 0)."""
    n = counts.sum()
    expected, observed = (exact.flatten() * n), counts.flatten()
    possible = exact.flatten() > 0
    if observed[~possible].sum() > 0:
        return 0.0
    expected, observed = expected[possible], observed[possible]
    big = expected >= 5
    exp, obs = expected[big], observed[big]
    if (~big).any():
        exp = torch.cat([exp, expected[~big].sum()[None]])
        obs = torch.cat([obs, observed[~big].sum()[None]])
    assert obs.sum() == n
    p = float(chisquare(obs.numpy(), exp.numpy() * (obs.sum() / exp.sum()).item()).pvalue)
    print(f"chi-square: n={int(n)} p={p:.3g}")  # shown when a check fails
    return p


def skip_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p  # broken: resample from p after a rejection instead of normalize(max(0, p - q))


def no_renormalization(tokens, parents, target_probs, generator, child_probs=None, drawn=None):
    """Broken tree rule: rejected siblings keep their mass and the fallback draws from the full p."""
    kids = acceptance.children_of(parents)
    node, accepted = 0, [0]
    while True:
        p = target_probs[node]
        for child in kids[node]:
            if torch.rand(1, generator=generator).item() < p[int(tokens[child])].item():
                node = child
                accepted.append(child)
                break
        else:
            return acceptance.Acceptance(nodes=torch.tensor(accepted), next_token=int(sample(p, generator)))


def test_speculative_sampling_is_lossless_and_the_check_has_teeth(model, monkeypatch):
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_triples(model, sampling)
    assert chi_square_p(sampled_triples(model, "sd", sampling, SAMPLES), exact) > ALPHA
    monkeypatch.setattr(acceptance, "residual_distribution", skip_residual)
    assert chi_square_p(sampled_triples(model, "sd", sampling, SAMPLES // 2), exact) < ALPHA


@pytest.fixture(scope="module")
def gguf_draft(model, tmp_path_factory, private_cost_curves):
    """A draft model read from a GGUF file as a model spec is (``load_gguf_target``: its codes kept, run by
    the lean forward): a random one-layer Llama over the target's 6 tokens, with the target's tokenizer."""
    from eagle.runtime.target import load_gguf_target
    from tests.runtime.test_gguf_weights import kernels_or_skip
    from tests.test_draft_models import private_cache, tiny_llama, write_llama_gguf

    kernels_or_skip()
    root = tmp_path_factory.mktemp("gguf-draft")
    with private_cache(root, private_cost_curves):
        path = write_llama_gguf(root / "draft.gguf", tiny_llama(VOCAB, seed=9, hidden=32, layers=1), 9, size=1.0)
        return load_gguf_target(path, "gguf-draft", tokenizer=model.target.tokenizer)


def test_speculative_sampling_with_a_gguf_draft_model_is_lossless_and_the_check_has_teeth(model, gguf_draft,
                                                                                        monkeypatch):
    """``sd`` drafting by a GGUF draft model's own lean forward and cache, as ``draft_model`` given as a GGUF
    file runs; the control resamples from p after a rejection."""
    from eagle.runtime.gguf_weights import GGUFModel

    sd = EagleModel.from_pretrained(model.target, draft_model=gguf_draft, gamma=2)
    sampling = SamplingConfig(temperature=1.0)
    assert isinstance(gguf_draft.model, GGUFModel) and sd._proposer("sd", sampling, None).model is gguf_draft
    exact = exact_triples(model, sampling)
    assert chi_square_p(sampled_triples(sd, "sd", sampling, SAMPLES), exact) > ALPHA
    drafted = [sd.generate(PROMPT, method="sd", max_new_tokens=3, temperature=1.0, seed=s).accept_lengths
               for s in range(200)]
    assert sum(max(lengths) > 1 for lengths in drafted) > 50  # drafts were accepted, not only bonus tokens
    monkeypatch.setattr(acceptance, "residual_distribution", skip_residual)
    assert chi_square_p(sampled_triples(sd, "sd", sampling, SAMPLES // 2), exact) < ALPHA


def test_speculative_sampling_with_a_draft_vocabulary_is_lossless_and_the_check_has_teeth(model, gguf_draft,
                                                                                        tmp_path, monkeypatch):
    """A draft model whose head computes 3 of the 6 tokens (a token-frequency table for the tokenizer,
    ``draft_vocab=3``): its distributions are zero on the others, which the target then never gets as drafts, and
    the first tokens still follow the target's; the control resamples from p after a rejection."""
    from eagle.drafting import token_frequencies

    counts = torch.tensor([5, 1, 4, 0, 3, 2])  # the draft vocabulary: tokens 0, 2 and 4
    monkeypatch.setattr(token_frequencies, "table_dirs", lambda: [tmp_path])
    token_frequencies.write_table(tmp_path / "tiny.pt",
                                  token_frequencies.table(counts, gguf_draft.tokenizer_fingerprint, "test"))
    sd = EagleModel.from_pretrained(model.target, draft_model=gguf_draft, gamma=2, draft_vocab=3)
    sampling = SamplingConfig(temperature=1.0)
    proposer = sd._proposer("sd", sampling, torch.Generator())
    assert set(proposer.vocab.tolist()) == {0, 2, 4} | set(gguf_draft.eos_token_ids)
    exact = exact_triples(model, sampling)
    assert chi_square_p(sampled_triples(sd, "sd", sampling, SAMPLES), exact) > ALPHA
    monkeypatch.setattr(acceptance, "residual_distribution", skip_residual)
    assert chi_square_p(sampled_triples(sd, "sd", sampling, SAMPLES // 2), exact) < ALPHA


def test_draft_chains_cut_by_the_drafts_confidence_are_lossless_and_the_check_has_teeth(model, gguf_draft,
                                                                                      monkeypatch):
    """``draft_confidence``: a chain stops after a drawn token whose q is below 0.5 (the draft's own draws decide
    its length, never the target's); the first tokens still follow the target's distribution."""
    sd = EagleModel.from_pretrained(model.target, draft_model=gguf_draft, gamma=3, draft_confidence=0.5)
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_triples(model, sampling)
    assert chi_square_p(sampled_triples(sd, "sd", sampling, SAMPLES), exact) > ALPHA
    monkeypatch.setattr(acceptance, "residual_distribution", skip_residual)
    assert chi_square_p(sampled_triples(sd, "sd", sampling, SAMPLES // 2), exact) < ALPHA


@pytest.mark.parametrize("top_p, lookup_tokens, sampled, temperature, total, scale, support",
                         [(1.0, 10, False, 1.0, 6, 1.0, 0), (0.8, 10, False, 1.0, 6, 1.0, 0),
                          (1.0, 0, False, 1.0, 6, 1.0, 0), (1.0, 10, True, 1.0, "auto", 0.85, 0),
                          (0.8, 10, True, 0.7, 6, 0.5, 3), (1.0, 0, True, 1.0, 6, 0.85, 2)])
def test_tree_sampling_is_lossless(model, spread, top_p, lookup_tokens, sampled, temperature, total, scale, support,
                                   tmp_path, monkeypatch):
    """``lookup_tokens``: prompt-lookup drafts grafted onto the tree (with 6 tokens, the last one
    has mostly occurred before from the second step on, so lookup drafts compete for the slots).
    ``sampled``: children drawn from the drafter and recursive speculative decoding (else the
    drafter's top-k children as deterministic drafts; drawn from the ``spread`` drafter); "auto"
    sizes them from past rounds. ``scale``: children drawn at the temperature times it
    (``draw_temperature_scale``); ``support``: drawn among the drafter's 3 or 2 most likely of the
    6 tokens (``draw_support``; 0: all 6)."""
    import eagle.decoding.tree_sizing

    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    monkeypatch.setattr(eagle.decoding.tree_sizing, "NOISY", float("inf"))
    sampling = SamplingConfig(temperature=temperature, top_p=top_p)
    exact = exact_triples(model, sampling)
    tree = dataclasses.replace(model.tree, lookup_tokens=lookup_tokens, sampled_tree=sampled, total_tokens=total,
                               draw_temperature_scale=scale, draw_support=support)
    tree_model = EagleModel(model.target, spread if sampled else model.drafter, tree=tree)
    counts = sampled_triples(tree_model, "eagle-tree", sampling, SAMPLES)
    assert chi_square_p(counts, exact) > ALPHA


def test_sampled_tree_with_lookup_grafts_is_lossless(model):
    """A prompt that repeats itself, so that prompt-lookup chains join the drawn tree in most
    rounds (~70%; with ``PROMPT`` ~10%), as new nodes after the drawn ones, judged as point masses."""
    sampling, prompt = SamplingConfig(temperature=1.0), [1, 2, 3, 1, 2]
    tree_model = EagleModel(model.target, model.drafter, tree=dataclasses.replace(model.tree, lookup_tokens=10))
    counts = sampled_triples(tree_model, "eagle-tree", sampling, SAMPLES, prompt)
    assert chi_square_p(counts, exact_triples(model, sampling, prompt)) > ALPHA


def test_sharpened_draws_are_lossless_and_must_be_judged_by_what_they_came_from(model, spread, monkeypatch):
    """Children drawn at half the temperature (``draw_temperature_scale`` 0.5): the output follows
    the target, and the same check rejects a rule told the distribution at the full temperature."""
    import eagle.decoding.proposers as proposers

    sampling = SamplingConfig(temperature=1.0)
    exact = exact_triples(model, sampling)
    sharp = EagleModel(model.target, spread, tree=dataclasses.replace(model.tree, draw_temperature_scale=0.5))
    assert chi_square_p(sampled_triples(sharp, "eagle-tree", sampling, SAMPLES), exact) > ALPHA
    told = proposers.DrawDistributions.support
    monkeypatch.setattr(proposers.DrawDistributions, "support",
                        lambda rows, node: told(dataclasses.replace(rows, temperature=rows.temperature / 0.5), node))
    assert chi_square_p(sampled_triples(sharp, "eagle-tree", sampling, SAMPLES // 2), exact) < ALPHA


def test_draws_among_the_top_tokens_must_be_judged_by_that_support(model, spread, monkeypatch):
    """Children drawn among the drafter's 2 most likely tokens (``draw_support`` 2) but the rule
    told the distribution over all 6 tokens they were not drawn from: the check rejects it (the
    same setting told the truth passes in ``test_tree_sampling_is_lossless``)."""
    import eagle.decoding.proposers as proposers

    drawn_among_top = proposers.EagleDrafter._children

    def untold(self, parent_scores, logprobs, k, nodes):
        out = drawn_among_top(self, parent_scores, logprobs, k, nodes)
        everything = torch.arange(logprobs.shape[-1]).expand(logprobs.shape[0], -1)
        self.drawn_from.update(zip(nodes, zip(everything, logprobs)))
        return out

    monkeypatch.setattr(proposers.EagleDrafter, "_children", untold)
    sampling = SamplingConfig(temperature=1.0)
    tree = dataclasses.replace(model.tree, lookup_tokens=0, draw_temperature_scale=0.85, draw_support=2)
    counts = sampled_triples(EagleModel(model.target, spread, tree=tree), "eagle-tree", sampling, SAMPLES // 2)
    assert chi_square_p(counts, exact_triples(model, sampling)) < ALPHA


def test_tree_sampling_negative_control_is_rejected(model, monkeypatch):
    sampling = SamplingConfig(temperature=1.0)
    monkeypatch.setattr(acceptance, "recursive_rejection_tree", no_renormalization)
    deterministic = EagleModel(model.target, model.drafter, tree=dataclasses.replace(model.tree, sampled_tree=False))
    counts = sampled_triples(deterministic, "eagle-tree", sampling, SAMPLES // 2)
    assert chi_square_p(counts, exact_triples(model, sampling)) < ALPHA


def without_replacement_ignored(tokens, parents, target_probs, generator, child_probs, drawn):
    """Broken sampled-tree rule: a rejected draw stays in q, so later draws are judged by a q
    they were not drawn from (a deterministic draft: as a point mass)."""
    kids = acceptance.children_of(parents)
    node, accepted = 0, [0]
    while True:
        r = target_probs[node].double()
        for child in kids[node]:
            x = int(tokens[child])
            q = child_probs[node].double() if drawn[child] else torch.nn.functional.one_hot(
                torch.tensor(x), r.shape[-1]).double()
            if torch.rand(1, generator=generator).item() * q[x] < r[x]:
                node = child
                accepted.append(child)
                break
            r = acceptance.residual_distribution(r, q)
        else:
            return acceptance.Acceptance(nodes=torch.tensor(accepted), next_token=int(sample(r, generator)))


def test_sampled_tree_negative_control_is_rejected(model, monkeypatch):
    """With the peaked drafter: there a rejected draw left in q costs the most (a second draw is
    judged by a q that still gives the first token ~0.7); with ``spread`` this control passes."""
    sampling = SamplingConfig(temperature=1.0)
    monkeypatch.setattr(acceptance, "recursive_rejection_tree", without_replacement_ignored)
    counts = sampled_triples(model, "eagle-tree", sampling, SAMPLES // 2)
    assert chi_square_p(counts, exact_triples(model, sampling)) < ALPHA


def over_accepting(tokens, parents, target_probs, generator, child_probs=None, drawn=None):
    """Broken rule for deterministic drafts: a draft x is accepted with probability sqrt(p(x)), not
    p(x), and the fallback draws from the full p."""
    kids = acceptance.children_of(parents)
    node, accepted = 0, [0]
    while True:
        p = target_probs[node]
        for child in kids[node]:
            if torch.rand(1, generator=generator).item() ** 2 < p[int(tokens[child])].item():
                node = child
                accepted.append(child)
                break
        else:
            return acceptance.Acceptance(nodes=torch.tensor(accepted), next_token=int(sample(p, generator)))


def test_sampled_prompt_lookup_is_lossless_and_the_check_has_teeth(model, monkeypatch):
    """Method ``pld`` at temperature 1 on a prompt that repeats itself, so that most rounds draft a
    looked-up chain (deterministic drafts, judged as point masses). The control over-accepts them
    (resampling from the full p after a rejection, ``skip_residual``, was too small an error for
    this check to see: p = 0.19 with 10k samples). Chains of a fixed length: sized by measured cost
    (``auto_length``), a busy machine can leave them empty."""
    model = EagleModel.from_pretrained(model.target, auto_length=False)
    sampling, prompt = SamplingConfig(temperature=1.0), [1, 2, 3, 1, 2]
    exact = exact_triples(model, sampling, prompt)
    counts = sampled_triples(model, "pld", sampling, SAMPLES // 2, prompt)
    assert chi_square_p(counts, exact) > ALPHA
    drafted = [model.generate(prompt, method="pld", max_new_tokens=3, temperature=1.0, seed=s).accept_lengths
               for s in range(200)]
    assert sum(max(lengths) > 1 for lengths in drafted) > 50  # looked-up drafts were accepted, not only bonus tokens
    monkeypatch.setattr(acceptance, "recursive_rejection_tree", over_accepting)
    assert chi_square_p(sampled_triples(model, "pld", sampling, SAMPLES // 4, prompt), exact) < ALPHA


def test_reduced_vocabulary_drafters_sampled_tree_is_lossless_and_the_check_has_teeth(model, monkeypatch):
    """A drafter over 4 of the 6 tokens (``draft_vocab_size``; d2t = [0, 2, 3, 5], so draft index
    and target id differ), its children drawn from it: the output follows the target, tokens 1 and
    4 included (they come only from residuals). The control tells the rule the draw distributions
    laid out by draft index instead of target id."""
    import eagle.decoding.proposers as proposers

    torch.manual_seed(2)
    counts = torch.tensor([9.0, 1.0, 8.0, 7.0, 2.0, 6.0])
    small = Drafter.from_target(model.target, token_counts=counts, draft_vocab_size=4).eval()
    assert small.d2t.tolist() == [0, 2, 3, 5]
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_triples(model, sampling)
    tree = dataclasses.replace(model.tree, sampled_tree=True, lookup_tokens=0, draw_support=0)
    reduced = EagleModel(model.target, small, tree=tree)
    sampled = sampled_triples(reduced, "eagle-tree", sampling, SAMPLES)
    assert chi_square_p(sampled, exact) > ALPHA
    assert sampled[:, 1].sum() > 0 and sampled[:, 4].sum() > 0
    told = proposers.DrawDistributions.support
    monkeypatch.setattr(proposers.DrawDistributions, "support", lambda rows, node: told(
        dataclasses.replace(rows, draft_ids=torch.arange(len(rows.draft_ids), device=rows.draft_ids.device)), node))
    assert chi_square_p(sampled_triples(reduced, "eagle-tree", sampling, SAMPLES // 2), exact) < ALPHA


def test_eagle3_drafters_sampled_tree_is_lossless_and_the_check_has_teeth(monkeypatch):
    """An EAGLE-3 drafter (fusing layers 0 and 1 of a 3-layer target; its own head over 4 of the 6
    tokens, d2t = [0, 2, 3, 5]; deeper levels fed its own hidden states), children drawn from it:
    the output follows the target, tokens 1 and 4 included (only from residuals). The control
    tells the rule the draw distributions laid out by draft index instead of target id."""
    import eagle.decoding.proposers as proposers
    from eagle.config import TreeConfig

    target = tiny_target(vocab_size=VOCAB, hidden=16, layers=3, init_std=0.5)
    torch.manual_seed(2)
    counts = torch.tensor([9.0, 1.0, 8.0, 7.0, 2.0, 6.0])
    drafter = Drafter.from_target(target, kind="eagle3", token_counts=counts, draft_vocab_size=4).eval()
    assert drafter.d2t.tolist() == [0, 2, 3, 5] and drafter.config.aux_layers == [0, 1]
    tree = TreeConfig(total_tokens=6, depth=3, top_k=2, sampled_tree=True, lookup_tokens=0, draw_support=0)
    model = EagleModel(target, drafter, tree=tree)
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_triples(model, sampling)
    sampled = sampled_triples(model, "eagle-tree", sampling, SAMPLES)
    assert chi_square_p(sampled, exact) > ALPHA
    assert sampled[:, 1].sum() > 0 and sampled[:, 4].sum() > 0
    drafted = [model.generate(PROMPT, method="eagle-tree", max_new_tokens=3, temperature=1.0, seed=s).accept_lengths
               for s in range(200)]
    assert sum(max(lengths) > 1 for lengths in drafted) > 50  # drawn drafts were accepted, not only bonus tokens
    told = proposers.DrawDistributions.support
    monkeypatch.setattr(proposers.DrawDistributions, "support", lambda rows, node: told(
        dataclasses.replace(rows, draft_ids=torch.arange(len(rows.draft_ids), device=rows.draft_ids.device)), node))
    assert chi_square_p(sampled_triples(model, "eagle-tree", sampling, SAMPLES // 2), exact) < ALPHA


def device_no_renormalization(tree, probs, uniform):
    """Broken device rule: a child is accepted with probability p(x) whatever its earlier siblings
    took, and the next token comes from the full p."""
    from eagle.decoding.device_rounds import DeviceAcceptance, deepest_agreeing
    from eagle.decoding.sampling import invert_cdf

    mass = probs[tree.parents.clamp(min=0), tree.tokens].double()
    index = torch.arange(tree.size)
    accepted = (uniform[:tree.size] < mass) & (index > 0)
    earlier = (tree.parents[:, None] == tree.parents[None, :]) & (index[None, :] < index[:, None])
    first = accepted & ~((earlier.double() @ accepted.double()) > 0)
    best, path, count = deepest_agreeing(tree, first)
    return DeviceAcceptance(path, count, invert_cdf(probs[best], uniform[tree.size]))


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_device_rounds_sampling_is_lossless_and_the_check_has_teeth(model, spread, top_p, monkeypatch):
    """Device rounds (``eagle.decoding.device_rounds``) at temperature 1: the drafter's top-k children
    (``spread``: deep and shallow nodes compete), accepted by ``sampled_accept`` on the device."""
    from eagle.decoding import device_rounds

    sampling = SamplingConfig(temperature=1.0, top_p=top_p)
    exact = exact_triples(model, sampling)
    tree = dataclasses.replace(model.tree, sampled_tree=False, lookup_tokens=0)
    device = EagleModel(model.target, spread, tree=tree, device_rounds=True)
    assert device._device_drafter("eagle-tree", sampling) is not None
    assert chi_square_p(sampled_triples(device, "eagle-tree", sampling, SAMPLES), exact) > ALPHA
    monkeypatch.setattr(device_rounds, "sampled_accept", device_no_renormalization)
    assert chi_square_p(sampled_triples(device, "eagle-tree", sampling, SAMPLES // 2), exact) < ALPHA



@pytest.mark.parametrize("capture", [False, True])
def test_device_rounds_drawn_children_are_lossless_and_the_check_has_teeth(model, spread, capture, request,
                                                                          monkeypatch):
    """Device rounds with drawn children (the default when sampling; ``drawn_accept``), among the
    ``spread`` drafter's 3 most likely tokens at 0.85 times the temperature: eagerly, and on the
    static path captured (by the CPU stand-in for CUDA capture: each replay draws new noise).
    Fewer samples than the host path's checks (a device round costs more on a CPU): the control,
    a rule that draws the next token from the full p after its node's children were rejected,
    fails at this size (``test_drawn_accept_follows_the_recursive_rule_in_distribution`` checks the
    rule itself with 40k vectorized draws)."""
    from eagle.decoding import device_rounds
    from eagle.decoding.sampling import invert_cdf

    sampling = SamplingConfig(temperature=1.0, top_p=0.8 if capture else 1.0)
    exact = exact_triples(model, sampling)
    tree = dataclasses.replace(model.tree, lookup_tokens=0, draw_support=3, draw_temperature_scale=0.85)
    target = model.target
    if capture:  # a target built after the fixture turned the compiled CPU kernels off
        from eagle.runtime.cuda_graphs import with_graphs

        request.getfixturevalue("fake_capture")
        target = with_graphs(tiny_target(vocab_size=VOCAB, hidden=16, layers=1, init_std=0.5))
    device = EagleModel(target, spread, tree=tree, device_rounds=True)
    assert device._device_drafter("eagle-tree", sampling).draw_temperature == pytest.approx(0.85)
    samples = DEVICE_SAMPLES // 2 if capture else DEVICE_SAMPLES
    assert chi_square_p(sampled_triples(device, "eagle-tree", sampling, samples), exact) > ALPHA
    if capture:
        runner = device._device_drafter("eagle-tree", sampling).drafter.runner
        assert any(key[0] == "draft phase" and entry.graph is not None for key, entry in runner.shapes.items())
        return
    intact = device_rounds.drawn_accept

    def residual_skipped(tree, probs, draws, uniform):
        acc = intact(tree, probs, draws, uniform)
        last = device_rounds.row(acc.path, acc.count - 1)
        return dataclasses.replace(acc, next_token=invert_cdf(device_rounds.row(probs, last), uniform[-1]))

    monkeypatch.setattr(device_rounds, "drawn_accept", residual_skipped)
    assert chi_square_p(sampled_triples(device, "eagle-tree", sampling, DEVICE_SAMPLES // 2), exact) < ALPHA
