"""``sd`` with a draft model given as a model spec (a GGUF file, a model folder) or a loaded ``Target``: the
draft runs by its own lean forward with its own cache (a GGUF draft's codes kept, never copied), greedy output
is ``ar``'s in the API and in ``eagle-generate``, and a draft with another vocabulary is refused in one line."""

import contextlib
import time

import pytest
import torch

from eagle import EagleError, EagleModel
from eagle.config import SamplingConfig
from eagle.runtime.gguf_weights import GGUFModel
from eagle.runtime.target import Target
from infer import cli

from tests.conftest import prompts, tiny_target
from tests.infer.test_cli import one_error_line
from tests.runtime.test_gguf_tokenizer import tiny_vocabulary
from tests.runtime.test_gguf_weights import LLAMA_TYPES, kernels_or_skip, write_model_gguf

Q8 = {name: "Q8_0" for name in LLAMA_TYPES}  # blocks of 32 weights: a hidden size of 64 will do


def tiny_llama(vocab_size: int, seed: int, hidden: int = 64, layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    return model


def write_llama_gguf(path, model: torch.nn.Module, seed: int, tokens: list[str] | None = None,
                     token_types: list[int] | None = None, size: float = 0.05):
    """``model`` written as a Q8_0 GGUF file of random codes of weights about ``size`` (``write_model_gguf``:
    the model takes the weights the codes give), with a SentencePiece vocabulary (``tokens``, their GGUF
    types) that transformers reads as the file's tokenizer, or none."""
    import tests.runtime.test_gguf_weights as gguf_weights

    write = gguf_weights.write_tensors

    def with_vocabulary(writer, tensors):
        if tokens is not None:
            writer.add_tokenizer_model("llama")
            writer.add_token_list(tokens)
            writer.add_token_types(token_types)
            writer.add_token_scores([0.0] * len(tokens))
            for add, token_id in ((writer.add_bos_token_id, 2), (writer.add_eos_token_id, 1),
                                  (writer.add_unk_token_id, 3), (writer.add_pad_token_id, 0)):
                add(token_id)
        write(writer, tensors)

    random_codes = gguf_weights.random_codes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_weights, "write_tensors", with_vocabulary)
        mp.setattr(gguf_weights, "random_codes", lambda *a, **k: random_codes(*a, **{**k, "size": size}))
        return write_model_gguf(path, model, Q8, seed=seed)


@contextlib.contextmanager
def private_cache(root, shared):
    """``EAGLE_CACHE`` set to a new cache under ``root`` for the block (what is derived from a test's GGUF files goes
    there, not to the cache of converted targets), its compiled kernels those of ``shared``."""
    cache = root / "cache"
    cache.mkdir()
    (cache / "extensions").symlink_to(shared / "extensions", target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def files(tmp_path_factory, private_cost_curves):
    """{"target": a tiny Llama GGUF file with a vocabulary, "same": a copy of it, "near": a model folder of the
    target's weights, a few of them changed (a draft agreeing with the target most of the time), "other": a
    GGUF file of another random model with the same vocabulary}, in a cache of their own (what is derived from a
    GGUF file goes there while the module runs: ``private_cache``)."""
    kernels_or_skip()
    root = tmp_path_factory.mktemp("draft-models")
    tokens, types = tiny_vocabulary()
    with private_cache(root, private_cost_curves):
        model = tiny_llama(len(tokens), seed=0)
        target = write_llama_gguf(root / "target.gguf", model, 0, tokens, types, size=0.3)
        same = root / "same.gguf"
        same.write_bytes(target.read_bytes())
        other = write_llama_gguf(root / "other.gguf", tiny_llama(len(tokens), seed=1), 1, tokens, types, size=0.3)
        with torch.no_grad():  # the target's de-quantized weights (``write_model_gguf`` set them), one layer changed
            model.model.layers[1].mlp.down_proj.weight.mul_(0.5)
        model.save_pretrained(root / "near")
        EagleModel.from_pretrained(str(target)).target.tokenizer.save_pretrained(root / "near")
        yield {"target": str(target), "same": str(same), "near": str(root / "near"), "other": str(other)}


TEXTS = ["abc dé", "ab ab ab", "€<> d c"]


@pytest.mark.parametrize("draft", ["same", "near", "other"])
def test_sd_with_a_model_spec_as_draft_model_is_ar(files, draft):
    """A GGUF file (the target's own model: every draft is accepted; another model's: most are rejected, so the
    draft's cache is rolled back every round) and a folder of a model close to the target (some rejected): the
    draft is loaded as a ``Target`` (a GGUF file's codes kept) and run as it is, greedy ``sd`` gives ``ar``'s
    tokens, and a draft that agrees with the target has its drafts accepted (its cache holds the accepted text)."""
    model = EagleModel.from_pretrained(files["target"], draft_model=files[draft], gamma=4, draft_confidence=0.0)
    accepted = []
    for text in TEXTS:
        ar = model.generate(text, method="ar", max_new_tokens=24)
        sd = model.generate(text, method="sd", max_new_tokens=24)
        assert sd.token_ids == ar.token_ids
        accepted.append(sd.mean_accept_length)
        assert model.generate(text, method="sd", max_new_tokens=24, temperature=1.0, seed=3).token_ids
    mean = sum(accepted) / len(accepted)
    assert isinstance(model.draft_model, Target) and model.draft_model.lean is not None
    assert isinstance(model.draft_model.model, GGUFModel) == (draft != "near")
    assert model._proposer("sd", SamplingConfig(), torch.Generator()).model is model.draft_model  # no copy
    # a GGUF file of the target's tokenizer metadata holds no tokenizer of its own; a folder has its own
    assert (model.draft_model.tokenizer is model.target.tokenizer) == (draft != "near")
    if draft == "same":
        assert mean > 4  # gamma grows while every draft is accepted
    elif draft == "near":
        assert 1.5 < mean < 4.5, accepted
    else:
        assert mean < 2, accepted


@pytest.mark.parametrize("draft", ["other", "near"])
def test_a_draft_model_takes_the_targets_int8_activations_where_it_keeps_codes(files, draft):
    """A target with int8 activations: a GGUF draft model is loaded with them too (the numerics the target
    decodes in), a folder's fp32 weights without; greedy ``sd`` gives ``ar``'s tokens in those numerics."""
    model = EagleModel.from_pretrained(files["target"], draft_model=files[draft], gamma=4, int8_activations=True)
    assert model.target.int8_activations and model.draft_model.int8_activations == (draft == "other")
    for text in TEXTS:
        ar = model.generate(text, method="ar", max_new_tokens=24)
        assert model.generate(text, method="sd", max_new_tokens=24).token_ids == ar.token_ids


def test_eagle_generate_runs_sd_with_a_model_spec_as_draft_model(files, capsys):
    """``--draft-model`` a GGUF file and a folder: the text of ``ar``."""
    base = ["--target", files["target"], "--max-new-tokens", "16", TEXTS[0]]
    assert cli.main([*base, "--method", "ar"]) == 0
    ar, _ = capsys.readouterr()
    for draft in ("other", "near"):
        assert cli.main([*base, "--method", "sd", "--draft-model", files[draft]]) == 0
        out, err = capsys.readouterr()
        assert out == ar and "[sd] " in err


def test_a_draft_model_with_another_vocabulary_is_refused_in_one_line(tmp_path, files, capsys):
    """A folder whose tokenizer and vocabulary are not the target's: refused when loaded, in the API and as one
    line with exit code 2 in ``eagle-generate``."""
    other = tiny_target(vocab_size=40)
    other.model.save_pretrained(tmp_path / "other")
    other.tokenizer.save_pretrained(tmp_path / "other")
    with pytest.raises(EagleError, match="another vocabulary or tokenizer"):
        EagleModel.from_pretrained(files["target"], draft_model=str(tmp_path / "other"))
    assert cli.main(["--target", files["target"], "--method", "sd", "--draft-model", str(tmp_path / "other"),
                     "--max-new-tokens", "4", TEXTS[0]]) == 2
    out, err = capsys.readouterr()
    assert "another vocabulary or tokenizer" in one_error_line(err, "eagle-generate") and out == ""


def test_a_folder_draft_model_of_a_tiny_target_is_ar(tmp_path):
    """A transformers target in memory, a draft model folder with its tokenizer: the draft runs by the lean
    forward of the folder's model; greedy ``sd`` is ``ar``; a loaded ``Target`` passed as draft model runs as it is."""
    target = tiny_target()
    draft = tiny_target(seed=5, hidden=16, layers=1)
    draft.model.save_pretrained(tmp_path)
    draft.tokenizer.save_pretrained(tmp_path)
    for spec in (str(tmp_path), draft):
        model = EagleModel.from_pretrained(target, draft_model=spec, gamma=3)
        assert isinstance(model.draft_model, Target) and model.draft_model.lean is not None
        for ids in prompts(6, seed=2):
            ar = model.generate(ids, method="ar", max_new_tokens=20).token_ids
            assert model.generate(ids, method="sd", max_new_tokens=20).token_ids == ar
    assert model.draft_model is draft  # a Target without static-shape runner is kept as it is


def test_a_module_draft_model_runs_through_the_same_proposer(target):
    """A transformers module as draft model (what the draft LMs are) still drafts through ``DraftModel``, by its
    inference copy held as a ``Target`` without a lean forward."""
    module = tiny_target(seed=5, hidden=16, layers=1).model
    model = EagleModel.from_pretrained(target, draft_model=module, gamma=3)
    proposer = model._proposer("sd", SamplingConfig(), torch.Generator())
    assert isinstance(proposer.model, Target) and proposer.model.lean is None and proposer.model.model is not module
    for ids in prompts(4, seed=6):
        ar = model.generate(ids, method="ar", max_new_tokens=16).token_ids
        assert model.generate(ids, method="sd", max_new_tokens=16).token_ids == ar
    assert len(model.generate([1, 2], method="sd", max_new_tokens=4, temperature=1.0, seed=1).token_ids) == 4


@pytest.mark.timed_gate
def test_sd_drafts_only_while_drafting_rounds_pay(monkeypatch):
    """``sd``'s gate (as ``eagle-tree``'s "auto"): once drafting rounds are known to give fewer tokens a second than
    plain ones, rounds verify the root alone but for probes (a generation's first two rounds, then after 16 plain
    ones); where they pay, every round drafts. Greedy output
    is ``ar``'s either way (the draft catches up on the tokens it skipped); where they pay, one plain round after the
    first ``PLAIN_EVERY[0]`` counted measures what drafting must beat."""
    import eagle.decoding.proposers as proposers
    from eagle.decoding.tree_sizing import PLAIN_EVERY, PROBE_ROUNDS, CostCurve

    curve = CostCurve(sizes=[1, 16], seconds=[1e-3, 1e-3])
    monkeypatch.setattr("eagle.decoding.tree_sizing.cost_curve", lambda target, greedy=False: curve)
    asked, slow = [], False
    propose = proposers.DraftModel.propose

    def recorded(self, ids, max_depth, max_nodes):
        asked.append(max_nodes > 1)
        if slow and max_nodes > 1:
            time.sleep(0.02)  # drafting rounds really slow: a generation's first probe finds them so
        return propose(self, ids, max_depth, max_nodes)

    monkeypatch.setattr(proposers.DraftModel, "propose", recorded)
    target, draft = tiny_target(), tiny_target(seed=5, hidden=16, layers=1)
    ids = [5, 6, 7, 8]
    for slow in (False, True):
        model = EagleModel.from_pretrained(target, draft_model=draft, gamma=3)
        gate = model._cost_sizing("sd", SamplingConfig()).gate
        gate.drafted_seconds, gate.drafted_tokens = (1e3, 1.0) if slow else (1e-9, 1e3)
        asked.clear()
        out = model.generate(ids, method="sd", max_new_tokens=40)
        assert len(asked) == len(out.accept_lengths)
        probes = [0, 1, 2 + 2 * PROBE_ROUNDS[0]]  # the generation's start (its first round not counted), then one
        drafted = [i for i, d in enumerate(asked) if d]
        fast = [i for i in range(len(asked)) if i != 1 + PLAIN_EVERY[0]]
        assert drafted[:3] == probes if slow else drafted == fast
        assert out.token_ids == model.generate(ids, method="ar", max_new_tokens=40).token_ids


@pytest.mark.parametrize("draft", ["same", "near"])
def test_a_draft_vocabulary_keeps_sd_ar_and_drafts_only_its_tokens(files, draft, monkeypatch):
    """With a token-frequency table for the tokenizer in the cache (``scripts/token_frequencies.py`` writes one
    there), ``sd``'s draft model computes the logits of its ``draft_vocab`` most frequent tokens only, from a copy of
    those rows of its head (the whole head's logits of them, bit for bit): every drafted token is among them (and
    the end-of-sequence ids), greedy ``sd`` still gives ``ar``'s tokens, and sampled ``sd`` runs; ``draft_vocab=0``
    and a tokenizer without a table compute the whole head."""
    from eagle.cache_dir import cache_root
    from eagle.decoding.proposers import DraftModel
    from eagle.drafting import token_frequencies

    model = EagleModel.from_pretrained(files["target"], draft_model=files[draft], gamma=4, draft_vocab=12)
    sd = model._proposer("sd", SamplingConfig(), torch.Generator())
    assert sd.head is None  # no table known for this tokenizer yet
    vocab = model.target.vocab_size
    counts = torch.arange(vocab)  # the higher the id, the more frequent
    path = cache_root() / "token_frequencies" / "tiny.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    token_frequencies.write_table(path, token_frequencies.table(counts, model.target.tokenizer_fingerprint, "test"))
    try:
        model = EagleModel.from_pretrained(files["target"], draft_model=files[draft], gamma=4, draft_vocab=12)
        sd = model._proposer("sd", SamplingConfig(), torch.Generator())
        allowed = set(range(vocab - 12, vocab)) | set(model.draft_model.eos_token_ids)
        assert sd.head is not None and set(sd.vocab.tolist()) == allowed
        hidden = torch.randn(3, model.draft_model.hidden_size)
        assert torch.equal(sd.head(hidden), model.draft_model.lm_head(hidden)[:, sd.vocab])
        drafted: list[int] = []
        propose = DraftModel.propose

        def recorded(self, ids, max_depth, max_nodes):
            proposal = propose(self, ids, max_depth, max_nodes)
            drafted.extend(proposal.tree.tokens[1:].tolist())
            return proposal

        monkeypatch.setattr(DraftModel, "propose", recorded)
        for text in TEXTS:
            ar = model.generate(text, method="ar", max_new_tokens=24)
            assert model.generate(text, method="sd", max_new_tokens=24).token_ids == ar.token_ids
            assert model.generate(text, method="sd", max_new_tokens=24, temperature=1.0, seed=3).token_ids
        assert drafted and set(drafted) <= allowed
        whole = EagleModel.from_pretrained(files["target"], draft_model=files[draft], draft_vocab=0)
        assert whole._proposer("sd", SamplingConfig(), torch.Generator()).head is None
    finally:
        path.unlink()


def test_a_draft_chain_stops_after_a_token_the_draft_doubts(files, monkeypatch):
    """``draft_confidence``: a chain ends after the first draft token whose probability under the draft model is
    below it (greedy: the softmax of its logits at its argmax), so chains vary in length up to ``gamma``; greedy
    ``sd`` still gives ``ar``'s tokens. Without it every chain has ``gamma`` tokens (the control)."""
    from eagle.decoding.proposers import DraftModel

    lengths: list[int] = []
    propose = DraftModel.propose

    def recorded(self, ids, max_depth, max_nodes):
        proposal = propose(self, ids, max_depth, max_nodes)
        if max_depth >= 6:
            lengths.append(proposal.tree.size - 1)
        return proposal

    monkeypatch.setattr(DraftModel, "propose", recorded)
    for confidence in (0.0, 0.9):
        model = EagleModel.from_pretrained(files["target"], draft_model=files["near"], gamma=6,
                                           draft_confidence=confidence)
        lengths.clear()
        for text in TEXTS:
            ar = model.generate(text, method="ar", max_new_tokens=32)
            assert model.generate(text, method="sd", max_new_tokens=32).token_ids == ar.token_ids
        drafted = [n for n in lengths if n > 0]  # (the gate may skip drafting: 0)
        assert drafted
        if confidence == 0.0:
            assert set(drafted) == {6}
        else:
            assert min(drafted) < 6 and max(drafted) > 1, drafted

