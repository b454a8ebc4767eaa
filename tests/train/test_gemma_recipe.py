"""The Gemma-3-270M recipes parse and build their drafters; a base model's chats are plain text."""

import json
from pathlib import Path

import pytest
import torch

from eagle.config import load_config_file
from train.data import tokenize_chat
from train.main import TrainConfig, build_student

from tests.conftest import tiny_gemma, word_tokenizer

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "recipes" / "gemma-3-270m" / "eagle3.yaml"


@pytest.mark.slow
def test_gemma_recipe_builds_an_eagle3_drafter_with_a_reduced_vocabulary(tmp_path):
    """A Gemma-3 target with the real layer count and a vocabulary above the draft one (a small hidden
    size keeps it cheap); the draft vocabulary counted from a small chat file standing in for the data."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"t{i} t{i + 1}"},
                                                      {"role": "assistant", "content": f" t{i + 2} t{i + 2}"}]}) + "\n"
                             for i in range(2, 60)))
    cfg = load_config_file(TrainConfig, str(RECIPE), [f"draft_vocab_data=[{chats}]"])
    assert cfg.target.endswith(".gguf") and cfg.online and cfg.draft_vocab_size == 32768
    target = tiny_gemma(vocab_size=40000, hidden=32, layers=18, lean=False)
    drafter = build_student(cfg, target, dataset=None).module
    assert drafter.config.kind == "eagle3" and drafter.config.draft_vocab_size == 32768
    assert drafter.config.aux_layers == [1, 8, 14]
    assert drafter.lm_head.out_features == 32768
    assert set(range(4, 62)) <= set(drafter.d2t.tolist())  # the replies' tokens are in the draft vocabulary


@pytest.mark.slow
def test_gemma_cpu_recipe_builds_an_eagle_drafter_started_from_the_targets_rows(tmp_path):
    """The EAGLE-1/2 recipe trained on a CPU: one layer, a 16384-token draft vocabulary whose head rows
    start as the target's embedding rows of those tokens; rows packed, features computed online."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"t{i} t{i + 1}"},
                                                      {"role": "assistant", "content": f" t{i + 2} t{i + 2}"}]}) + "\n"
                             for i in range(2, 60)))
    cfg = load_config_file(TrainConfig, str(RECIPE.with_name("train.yaml")), [f"draft_vocab_data=[{chats}]"])
    assert cfg.online and cfg.pack_tokens >= cfg.max_length and cfg.autocast == "none" and cfg.max_wall_s > 0
    target = tiny_gemma(vocab_size=40000, hidden=32, layers=18, lean=False)
    drafter = build_student(cfg, target, dataset=None).module
    assert drafter.config.kind == "eagle" and drafter.config.draft_vocab_size == 16384 == drafter.lm_head.out_features
    rows = target.model.get_output_embeddings().weight[drafter.d2t]
    assert torch.equal(drafter.lm_head.weight, rows.float())
    assert set(range(4, 62)) <= set(drafter.d2t.tolist())


def test_without_a_chat_template_a_chat_is_its_contents_back_to_back():
    tok = word_tokenizer(32)
    assert not getattr(tok, "chat_template", None)
    ex = tokenize_chat(tok, [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": " t7 t8"}], 100)
    assert tok.convert_ids_to_tokens(ex["input_ids"]) == ["t5", "t6", "t7", "t8"]
    assert ex["loss_mask"] == [0, 0, 1, 1]
