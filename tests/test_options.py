"""Every option a user passes is honoured or refused, never dropped: ``--set`` in each command that
has it (repeated, several pairs after one flag, a key given twice), and the one line that names
options a mode does not read."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

import train.main
from eagle.config import changed_keys, load_config_file, parse_overrides
from eagle.errors import EagleError, note_ignored
from train import card, features, selfdistill
from train.main import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "configs" / "recipes" / "smollm2-135m-instruct"


def one_line(err: str, prog: str, kind: str = "error") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: {kind}: "), err
    return lines[0]


# the commands with --set, and what each runs with the config it parsed (replaced here by a recorder)
COMMANDS = {"eagle-train": (train.main, "train"), "eagle-features": (features, "build"),
            "eagle-selfdistill": (selfdistill, "run")}


@pytest.fixture
def ran(monkeypatch):
    seen = []
    for module, name in COMMANDS.values():
        monkeypatch.setattr(module, name, lambda cfg, *args, **kwargs: seen.append(cfg))
    return seen


@pytest.mark.parametrize("prog, key", [("eagle-train", "max_wall_s"), ("eagle-features", "max_length"),
                                       ("eagle-selfdistill", "seed")])
def test_every_set_flag_and_every_pair_after_one_is_kept(prog, key, ran, tmp_path):
    argv = ["--set", f"out_dir={tmp_path / 'try'}", "--set", "target=t0", "--set", f"{key}=90", "target=t0"]
    assert COMMANDS[prog][0].main(argv) == 0
    (cfg,) = ran
    assert (cfg.out_dir, cfg.target, getattr(cfg, key)) == (str(tmp_path / "try"), "t0", 90)


@pytest.mark.parametrize("prog", list(COMMANDS))
def test_an_unknown_key_is_refused_in_any_set_flag(prog, ran, capsys):
    assert COMMANDS[prog][0].main(["--set", "nonexistent=1", "--set", "out_dir=X"]) == 2
    assert "unknown config key(s) 'nonexistent'" in one_line(capsys.readouterr().err, prog) and not ran


@pytest.mark.parametrize("prog", list(COMMANDS))
def test_a_key_set_twice_to_different_values_is_an_error_naming_both(prog, ran, capsys):
    assert COMMANDS[prog][0].main(["--set", "out_dir=runs/a", "--set", "target=t0", "out_dir=runs/b"]) == 2
    assert one_line(capsys.readouterr().err, prog) == \
        f"{prog}: error: out_dir is set twice, to different values: 'out_dir=runs/a' and 'out_dir=runs/b'"
    assert not ran


def test_parse_overrides():
    assert parse_overrides(["a=1", "b=[x, y]", "a=1.0", "c="]) == {"a": 1, "b": ["x", "y"], "c": None}
    with pytest.raises(EagleError, match="'b' is not KEY=VALUE"):
        parse_overrides(["a=1", "b"])
    with pytest.raises(EagleError, match="'a=true' and 'a=false'"):
        parse_overrides(["a=true", "a=false"])


def test_train_flags_that_are_config_keys_go_through_the_same_check(ran, capsys):
    assert train.main.main(["--report-to", "none", "--set", "max_wall_s=90"]) == 0
    assert (ran[0].report_to, ran[0].max_wall_s) == ("none", 90)
    assert train.main.main(["--report-to", "none", "--set", "report_to=wandb"]) == 2
    assert "report_to is set twice" in one_line(capsys.readouterr().err, "eagle-train")
    assert train.main.main(["--set", "report_to=tensorboard"]) == 2
    assert "report_to must be one of wandb, none" in one_line(capsys.readouterr().err, "eagle-train")
    assert selfdistill.main(["--max-new-tokens", "64"]) == 0 and ran[-1].answer_max_tokens == 64
    assert selfdistill.main(["--max-new-tokens", "64", "--set", "answer_max_tokens=32"]) == 2


def test_note_ignored_names_each_option_once_one_line_per_reason(capsys):
    lines = note_ignored("prog", {"--a", "--b", "--c"}, [
        (("--a", "--x"), True, "with mode m"), (("--b",), False, "never"), (("--a", "--b"), True, "with mode m"),
        (("--c",), True, "at temperature 0")])
    assert lines == ["prog: warning: --a, --b are ignored with mode m", "prog: warning: --c is ignored at temperature 0"]
    assert capsys.readouterr().err.splitlines() == lines
    assert note_ignored("prog", set(), [(("--a",), True, "always")]) == []


@pytest.mark.parametrize("recipe", ["train", "draft-lm", "eagle3"])
def test_the_shipped_recipes_set_no_key_they_do_not_read(recipe):
    cfg = load_config_file(TrainConfig, str(RECIPES / f"{recipe}.yaml"))
    kind = json.loads((ROOT / cfg.drafter_config).read_text()).get("kind", "eagle") if cfg.student == "drafter" else ""
    assert note_ignored("eagle-train", changed_keys(cfg), train.main.ignored_rules(cfg, kind)) == []


def test_train_keys_a_run_does_not_read_are_named():
    def notes(kind: str = "eagle", **keys) -> list[str]:
        cfg = TrainConfig(**keys)
        return note_ignored("eagle-train", changed_keys(cfg), train.main.ignored_rules(cfg, kind))

    assert notes(online=True, data="d", features="f") == [
        "eagle-train: warning: features is ignored with online: true (features are computed during training)"]
    assert notes(features="f", data="d", report_to="none", wandb_project="p") == [
        "eagle-train: warning: data is ignored without online: true (the stored features are read)",
        "eagle-train: warning: wandb_project is ignored with report_to: none"]
    assert notes("", features="f", student="draft-lm", num_layers=2, unroll_steps=3, noise=0.2) == [
        "eagle-train: warning: num_layers, unroll_steps, noise are ignored with student: draft-lm"]
    assert notes(features="f", init_from="d", drafter_config="x.json", lm_ce_positions=8) == [
        "eagle-train: warning: lm_ce_positions is ignored with student: drafter",
        "eagle-train: warning: drafter_config is ignored with init_from (the warm start's architecture is kept)"]
    assert notes("eagle3", features="f", feature_weight=2.0, unroll_decay=0.5) == [
        "eagle-train: warning: unroll_decay is ignored with unroll_steps: 1",
        "eagle-train: warning: feature_weight is ignored for an eagle3 drafter (trained on the cross-entropy alone)"]
    assert notes("eagle3", features="f", feature_weight=0.0, unroll_steps=7, unroll_decay=0.5) == []


def test_features_replay_seed_without_replay_is_named(ran, capsys):
    assert features.main(["--set", "replay_seed=4"]) == 0
    assert one_line(capsys.readouterr().err, "eagle-features", "warning") == \
        "eagle-features: warning: replay_seed is ignored without replay"
    assert features.main(["--set", "replay_seed=4", "replay={x.jsonl: 2}"]) == 0
    assert capsys.readouterr().err == ""


def test_selfdistill_modes_refuse_or_name_what_they_do_not_read(ran, capsys, monkeypatch, tmp_path):
    assert selfdistill.main(["--answer", "p.jsonl", "--compose", "3", "--out", "o.jsonl"]) == 2
    assert "give one of them" in one_line(capsys.readouterr().err, "eagle-selfdistill")
    assert selfdistill.main(["--out", "o.jsonl"]) == 2  # the run itself writes to out_dir
    assert "--set out_dir=DIR" in one_line(capsys.readouterr().err, "eagle-selfdistill") and not ran
    assert selfdistill.main(["--templates", "t.yaml", "--exclude", "a", "--set", "num_conversations=5"]) == 0
    assert one_line(capsys.readouterr().err, "eagle-selfdistill", "warning") == \
        "eagle-selfdistill: warning: --templates, --exclude are ignored without --compose"
    excluded = []
    monkeypatch.setattr(selfdistill, "known_prompts", lambda paths: excluded.extend(paths) or frozenset())
    out = tmp_path / "prompts.jsonl"
    assert selfdistill.main(["--compose", "2", "--out", str(out), "--exclude", "a", "b", "--exclude", "c",
                             "--set", "seed=4", "batch_size=3"]) == 0
    assert excluded == ["a", "b", "c"] and len(out.read_text().splitlines()) == 2
    assert one_line(capsys.readouterr().err, "eagle-selfdistill", "warning") == \
        "eagle-selfdistill: warning: batch_size is ignored with --compose"
    cfg = str(RECIPES / "selfdistill.yaml")
    monkeypatch.setattr(selfdistill, "answer_prompts", lambda target, prompts, max_new_tokens, *a: ran.append(
        max_new_tokens))
    monkeypatch.setattr(selfdistill, "load_target", lambda spec: None)
    monkeypatch.setattr("eagle.prompts.read_prompts", lambda path: [])
    assert selfdistill.main(["--config", cfg, "--answer", "p.jsonl", "--out", "o.jsonl", "--max-new-tokens",
                             "256"]) == 0
    assert ran[-1] == 256  # --max-new-tokens is answer_max_tokens: the answers' length in both modes
    assert one_line(capsys.readouterr().err, "eagle-selfdistill", "warning") == (
        "eagle-selfdistill: warning: out_dir, num_conversations, passage_fraction, constraint_fraction are ignored "
        "with --answer (keys of the self-distillation run)")


def test_card_keeps_every_repeated_file_flag_and_names_those_a_draft_lm_card_ignores(monkeypatch, tmp_path, capsys):
    rendered = []
    monkeypatch.setattr(card, "_load", lambda path: {"path": path})
    monkeypatch.setattr(card, "render", lambda folder, *records: rendered.append(records) or "card")
    monkeypatch.setattr(card, "render_draft_lm", lambda folder, *records: "card")
    records = ["--selfdistill", "s", "--features", "f", "--summary", "m", "--bench", "b", "--train-config", "t"]
    assert card.main(["--drafter", str(tmp_path), *records, "--fixed-tree-bench", "x", "y",
                      "--fixed-tree-bench", "z", "--init-summary", "i", "--init-summary", "j"]) == 0
    assert [r["path"] for r in rendered[0][-2]] == ["x", "y", "z"] and [r["path"] for r in rendered[0][-1]] == ["i", "j"]
    capsys.readouterr()
    assert card.main(["--draft-lm", str(tmp_path), *records, "--fixed-tree-bench", "x"]) == 0
    assert one_line(capsys.readouterr().err, "eagle-card", "warning") == \
        "eagle-card: warning: --fixed-tree-bench is ignored with --draft-lm"


def test_generate_and_bench_flag_rules_without_a_model(capsys):
    from infer import bench, cli

    def notes(module, methods: list[str], label: str, *argv: str) -> list[str]:
        parser = module.build_parser()
        args = cli.parse_command(parser, [*argv, "--prompts", "p.jsonl"] if module is bench else [*argv, "hi"],
                                 *([bench.BenchOptions] if module is bench else []))
        return cli.note_ignored_flags(module.PROG, parser, args, methods, label)

    assert notes(cli, ["sd"], "with method sd", "--total-tokens", "5", "--set", "gamma=3", "--set",
                 "drafter_dtype=float32",
                 "--temperature", "1", "--top-k", "4") == [
        "eagle-generate: warning: --total-tokens is ignored with method sd"]
    assert notes(cli, ["eagle-tree"], "with method eagle-tree", "--set", "drafter_dtype=bfloat16", "--set",
                 "drafter_quant=q8_0", "--set", "device_rounds=true", "--temperature", "0.5") == [
        "eagle-generate: warning: drafter_dtype is ignored with drafter_quant q8_0 (the quantized drafter "
        "computes in float32)"]
    assert notes(cli, ["eagle-tree"], "x", "--set", "device_rounds=true", "--set", "sampled_tree=false",
                 "--temperature", "0.5") == []
    assert notes(cli, ["eagle-tree"], "x", "--set", "device_rounds=true", "--temperature", "0.5") == []  # drawn too
    assert notes(bench, ["hf", "llama.cpp-eagle3"], "with --methods hf,llama.cpp-eagle3", "--drafter", "d",
                 "--set", "cuda_graphs=true") == [
        "eagle-bench: warning: cuda_graphs is ignored with --methods hf,llama.cpp-eagle3"]


def test_the_shared_parser_refuses_a_flag_given_twice_with_different_values():
    from eagle.errors import Parser

    parser = Parser(prog="p")
    parser.add_argument("--n", type=int)
    parser.add_argument("--flag", action="store_true")
    assert parser.parse_args(["--n", "3", "--n", "3", "--flag", "--flag"]).n == 3
    with pytest.raises(EagleError, match="--n is given twice, with different values: 3 and 4"):
        parser.parse_args(["--n", "3", "--n", "4"])
    assert parser.parse_args(["--n", "4"]).n == 4  # a new parse starts afresh


def test_generate_bench_and_serve_take_tuning_options_as_config_keys(tmp_path):
    """``--config FILE`` (YAML or JSON) and ``--set``: the API's option names; ``--set`` wins over the file;
    an unknown key, a value of the wrong type and a knob given as a flag are one-line errors."""
    from infer import bench, cli, serve

    yaml_file, json_file = tmp_path / "tune.yaml", tmp_path / "tune.json"
    yaml_file.write_text("depth: 3\ntop_k: 4\nsampled_tree: false\ndevice_rounds: true\n")
    json_file.write_text(json.dumps({"lookup_tokens": 0, "drafter_quant": "none", "max_queue": 2}))
    args = cli.parse_command(cli.build_parser(), ["--config", str(yaml_file), "--set", "depth=5", "hi"])
    assert (args.depth, args.tree_top_k, args.sampled_tree, args.device_rounds) == (5, 4, False, True)
    assert args.config_keys == {"depth", "top_k", "sampled_tree", "device_rounds"} and args.top_k == 0
    assert cli.option_args(args)["top_k"] == 4  # the tree's top_k reaches from_pretrained under its own name
    args = cli.parse_command(serve.build_parser(), ["--config", str(json_file)], serve.ServeOptions)
    assert (args.lookup_tokens, args.drafter_quant, args.max_queue, args.warmup) == (0, "none", 2, True)
    for argv, classes, message in [
            (["--set", "max_queue=2", "hi"], (), "unknown config key(s) 'max_queue'"),
            (["--set", "depth=two", "hi"], (), "depth must be an integer, got 'two'"),
            (["--set", "drafter_dtype=int4", "hi"], (), "drafter_dtype must be one of auto, float32"),
            (["--depth", "3", "hi"], (), "--depth is a config key: --set depth=VALUE (or in a --config file)"),
            (["--no-sampled-tree", "hi"], (), "--no-sampled-tree is a config key: --set sampled_tree=false"),
            (["--tree-top-k=2", "hi"], (), "--tree-top-k is a config key: --set top_k=VALUE"),
            (["--config", str(tmp_path / "none.yaml"), "hi"], (), "config file not found")]:
        with pytest.raises(EagleError, match=re.escape(message)):
            cli.parse_command(cli.build_parser(), argv, *classes)
    with pytest.raises(EagleError, match="--warmup is a config key: --set warmup=VALUE"):
        cli.parse_command(bench.build_parser(), ["--prompts", "p", "--warmup", "0"], bench.BenchOptions)
    assert cli.main(["--set", "depth=x", "hi"]) == 2  # one line through the command too


def test_the_options_page_holds_the_generated_config_key_table():
    from infer.config_keys import config_key_table

    assert config_key_table() in (ROOT / "docs" / "options.md").read_text()


def test_suffix_knobs_are_one_config_key_as_in_the_api(tmp_path, monkeypatch):
    """``suffix``: a mapping of ``SuffixConfig``'s keys, from ``--set`` or ``--config``, reaching
    ``EagleModel.from_pretrained(suffix=...)`` as given; an unknown or bad inner key is a one-line error."""
    from eagle.config import SuffixConfig
    from eagle.engine import EagleModel
    from infer import bench, cli

    (tmp_path / "tune.yaml").write_text("suffix:\n  max_depth: 24\n  prior: 0.5\n")
    args = cli.parse_command(cli.build_parser(), ["--config", str(tmp_path / "tune.yaml"), "hi"])
    assert SuffixConfig(**args.suffix) == SuffixConfig(max_depth=24, prior=0.5) and "suffix" in args.config_keys
    args = cli.parse_command(bench.build_parser(), ["--prompts", "p", "--set", "suffix={min_token_prob: 0.2}"],
                             bench.BenchOptions)
    seen = {}
    monkeypatch.setattr(EagleModel, "from_pretrained", classmethod(lambda cls, *a, **k: seen.update(k)))
    cli.load_model(args)
    assert seen["suffix"] == {**dataclasses.asdict(SuffixConfig()), "min_token_prob": 0.2}
    for value, message in [("{depth: 3}", "unknown config key(s) 'depth' in suffix"),
                           ("{max_depth: 0}", "max_depth must be >= 1"), ("3", "expected a mapping")]:
        with pytest.raises(EagleError, match=re.escape(message)):
            cli.parse_command(cli.build_parser(), ["--set", f"suffix={value}", "hi"])
