"""Bad input is one clear line: ``eagle-<tool>: error: ...`` and exit code 2 at the command line,
``EagleError`` from Python; the cheap checks run before any model is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle.drafting import draft_lm
from eagle.config import SamplingConfig, SpeculativeConfig, TreeConfig, PromptLookupConfig
from eagle.drafting.drafter import Drafter
from eagle.errors import EagleError
from eagle.engine import EagleModel
from infer import cli
from train import features

from tests.conftest import save_tiny_model, tiny_target

ROOT = Path(__file__).resolve().parent.parent

# Runs eagle-generate or eagle-bench with a tripwire: a check that is not made before the model loads
# shows as exit code 99 instead of the expected one line. eagle-generate must refuse before it even
# imports torch; eagle-bench (which imports it to time things) before it loads the target.
TRIPWIRE = """
import sys

tool = sys.argv[1]
if tool == "cli":
    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                print("torch was imported", file=sys.stderr)
                sys.exit(99)

    sys.meta_path.insert(0, NoTorch())
else:
    import eagle.engine

    def loaded(*args, **kwargs):
        print("the model load was reached", file=sys.stderr)
        sys.exit(99)

    eagle.engine.load_target = loaded
import importlib

sys.exit(importlib.import_module(f"infer.{tool}").main(sys.argv[2:]))
"""


def run_tool(tool: str, *args: str | bytes) -> tuple[int, str, str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", TRIPWIRE, tool, *args], capture_output=True, env=env, cwd=ROOT,
                          timeout=120)
    return (proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"),
            time.perf_counter() - start)


def one_line(err: str, prog: str = "eagle-generate") -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0][len(f"{prog}: error: "):]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A target folder, a drafter folder for it, a file that is named .gguf but is not one."""
    root = tmp_path_factory.mktemp("bad-input")
    save_tiny_model(root)
    (root / "x.gguf").write_text("not a gguf file\n")
    return root


# ---- the command line: refused before the model loads -------------------------------------------
@pytest.mark.slow
def test_the_command_line_refuses_bad_input_in_one_line_before_loading(files, tmp_path):
    """One subprocess per case (a fresh interpreter, as a user runs it), which must refuse before
    it imports torch (the tripwire would exit 99): the time it takes is the interpreter's start."""
    cases = [
        (["--temperature", "nan", "--max-new-tokens", "4", "Hi"], "temperature must be a finite number, got nan"),
        (["--temperature", "inf", "Hi"], "temperature must be a finite number, got inf"),
        (["--top-p", "nan", "Hi"], "top_p must be a finite number, got nan"),
        ([b"Hi \xff"], "the prompt is not valid UTF-8 text (byte 0xff at character 3)"),
        ([""], "empty prompt"),
        (["   "], "empty prompt"),
        (["--target", str(tmp_path / "no-such-folder"), "Hi"], f"model folder not found: {tmp_path / 'no-such-folder'}"),
        (["--target", str(files / "x.gguf"), "Hi"],
         f"{files / 'x.gguf'} is not a GGUF file (it does not start with the bytes 'GGUF')"),
        (["--drafter", str(tmp_path / "nope"), "Hi"], f"no drafter at {tmp_path / 'nope'}: no such folder"),
        (["--set", "depth=-1", "Hi"], "depth must be >= 0 (0: the root's children only), got -1"),
        (["--seed", "x", "Hi"], "argument --seed: invalid int value: 'x'"),
        (["--max-new-tokens", "0", "Hi"], "max_new_tokens must be >= 1, got 0"),
    ]
    for args, message in cases:
        rc, out, err, seconds = run_tool("cli", *args)
        assert (rc, out, one_line(err)) == (2, "", message), (args, err)
        assert seconds < 5, (args, seconds)  # well under a second on an idle machine; the real target loads in 10-25 s


@pytest.mark.slow
def test_eagle_bench_refuses_bad_files_before_loading(files, tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"prompt": "t3 t4"}) + "\n")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"prompt": "t3"}).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    folder = tmp_path / "a-folder"
    folder.mkdir()
    cases = [
        (["--prompts", str(latin1)], f"{latin1}:2: not UTF-8 text (byte 0xe9 at column 16)"),
        (["--prompts", str(tmp_path / "none.jsonl")], f"prompt file not found: {tmp_path / 'none.jsonl'}"),
        (["--prompts", str(good), "--json", str(folder)], f"--json {folder} is a folder, not a file"),
        (["--prompts", str(good), "--json", "/proc/no/such.json"],
         "--json /proc/no/such.json: cannot write it (No such file or directory)"),
    ]
    for args, message in cases:
        rc, out, err, _ = run_tool("bench", "--target", str(files / "target"), *args)
        assert (rc, out, one_line(err, "eagle-bench")) == (2, "", message), (args, err)


# ---- the command line: refused while loading --------------------------------------------------
def damaged_drafter(files: Path, tmp_path: Path, how: str) -> Path:
    out = tmp_path / how
    out.mkdir()
    config = json.loads((files / "drafter" / "config.json").read_text())
    weights = (files / "drafter" / "model.safetensors").read_bytes()
    if how == "truncated":
        weights = weights[: len(weights) // 2]
    elif how == "hidden-size":
        config["hidden_size"] = 64
    elif how == "missing-key":
        del config["intermediate_size"]
    elif how == "wrong-type":
        config["num_attention_heads"] = "four"
    (out / "config.json").write_text("{not json" if how == "not-json" else json.dumps(config))
    (out / "model.safetensors").write_bytes(weights)
    return out


@pytest.mark.parametrize("how, message", [
    ("truncated", "cannot read {dir}/model.safetensors (damaged or truncated?): "),
    ("hidden-size", "drafter weights {dir}/model.safetensors do not match the config: fc.weight has shape [32, 64], "
                    "the config implies [64, 128]"),
    ("not-json", "cannot read {dir}/config.json: Expecting property name enclosed in double quotes"),
    ("missing-key", "missing config key(s) 'intermediate_size' in {dir}/config.json"),
    ("wrong-type", "num_attention_heads must be an integer, got 'four' in {dir}/config.json"),
])
def test_a_damaged_drafter_is_one_line(files, tmp_path, capsys, how, message):
    folder = damaged_drafter(files, tmp_path, how)
    assert cli.main(["--target", str(files / "target"), "--drafter", str(folder), "--max-new-tokens", "2", "t3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and one_line(err).startswith(message.format(dir=folder)), err
    with pytest.raises(EagleError, match="^" + message.format(dir=folder).replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]").replace("?", r"\?")):
        Drafter.from_pretrained(folder)


def test_a_damaged_target_folder_is_one_line(files, tmp_path, capsys):
    folder = tmp_path / "target"
    folder.mkdir()
    for f in (files / "target").iterdir():
        data = f.read_bytes()
        (folder / f.name).write_bytes(data[: len(data) // 3] if f.name == "model.safetensors" else data)
    assert cli.main(["--target", str(folder), "t3"]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"cannot load model '{folder}' (damaged files?): ")


def test_a_damaged_draft_lm_is_one_line(tmp_path):
    target = tiny_target(tied=True)
    draft_lm.save(draft_lm.from_target(target, draft_lm.DraftLMConfig([0])), tmp_path / "lm", target)
    assert draft_lm.load(tmp_path / "lm", target) is not None
    weights = (tmp_path / "lm" / "model.safetensors").read_bytes()
    (tmp_path / "lm" / "model.safetensors").write_bytes(weights[:100])
    with pytest.raises(EagleError, match=f"^cannot read {tmp_path / 'lm' / 'model.safetensors'} \\(damaged"):
        draft_lm.load(tmp_path / "lm", target)
    (tmp_path / "lm" / "config.json").write_text("{")
    with pytest.raises(EagleError, match="^cannot read the draft LM's .*config.json"):
        draft_lm.load(tmp_path / "lm", target)
    (tmp_path / "lm" / draft_lm.MARKER).write_text("[]")
    with pytest.raises(EagleError, match="is not a JSON object"):
        draft_lm.load(tmp_path / "lm", target)


# ---- Python: options ---------------------------------------------------------------------------
nan, inf = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=nan), "temperature must be a finite number, got nan"),
    (dict(temperature=inf), "temperature must be a finite number, got inf"),
    (dict(temperature="1"), "temperature must be a number, got '1'"),
    (dict(top_p=nan), "top_p must be a finite number, got nan"),
    (dict(top_p=-inf), "top_p must be a finite number, got -inf"),
    (dict(top_k=1.5), "top_k must be an integer, got 1.5"),
    (dict(top_k=True), "top_k must be an integer, got True"),
    (dict(seed="x"), "seed must be an integer, got 'x'"),
    (dict(seed=1.0), "seed must be an integer, got 1.0"),
    (dict(seed=1 << 70), "seed must be in [-2**63, 2**64), got 1180591620717411303424"),
    (dict(max_new_tokens="5"), "max_new_tokens must be an integer, got '5'"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer, got True"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an integer, got 2.0"),
    (dict(method=None), "unknown method None"),
    (dict(stream="yes"), "stream must be true or false, got 'yes'"),
])
def test_bad_generate_arguments_are_eagle_errors(target, kwargs, message):
    model = EagleModel(target)
    with pytest.raises(EagleError) as error:
        model.generate([1, 2, 3], **{"method": "ar", **kwargs})
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("prompt, message", [
    ([1, 10 ** 7], "token id 10000000 is out of range: the vocabulary of tiny-llama-0 has ids 0..31"),
    ([1, -5], "token id -5 is out of range"),
    ([1, True], "prompt must be a string, a list of chat messages, or a list/tensor of token ids"),
    (torch.tensor([1.0, 2.0]), "token ids must be integers, got a tensor of torch.float32"),
    (torch.tensor([1, 40]), "token id 40 is out of range"),
    ("", "empty prompt"),
    (" \n", "empty prompt"),
    ("Hi \udcff", "the prompt is not valid UTF-8 text (byte 0xff at character 3)"),
    ([{"role": "user", "content": "t3 \ud800"}], "the prompt is not valid UTF-8 text (character '\\ud800'"),
    ([{"role": "user", "content": 5}], "a chat message needs a 'role' and a 'content' string"),
    ([], "empty prompt"),
])
def test_bad_prompts_are_eagle_errors(target, prompt, message):
    with pytest.raises(EagleError) as error:
        EagleModel(target).generate(prompt, max_new_tokens=2)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("cls, kwargs, message", [
    (TreeConfig, dict(total_tokens=True), "total_tokens must be a positive integer or 'auto', got True"),
    (TreeConfig, dict(total_tokens=2.5), "total_tokens must be a positive integer or 'auto', got 2.5"),
    (TreeConfig, dict(total_tokens=nan), "total_tokens must be a positive integer or 'auto', got nan"),
    (TreeConfig, dict(depth=1.5), "depth must be an integer, got 1.5"),
    (TreeConfig, dict(depth=False), "depth must be an integer, got False"),
    (TreeConfig, dict(top_k=True), "top_k must be an integer, got True"),
    (TreeConfig, dict(lookup_tokens="3"), "lookup_tokens must be an integer, got '3'"),
    (TreeConfig, dict(draw_temperature_scale=inf), "draw_temperature_scale must be a finite number, got inf"),
    (TreeConfig, dict(draw_temperature_scale=nan), "draw_temperature_scale must be a finite number, got nan"),
    (TreeConfig, dict(sampled_tree=1), "sampled_tree must be true or false, got 1"),
    (TreeConfig, dict(choices=[["a"]]), "a tree choice's rank must be an integer, got 'a'"),
    (TreeConfig, dict(choices=[1]), "tree choices must be lists of child ranks, got [1]"),
    (SpeculativeConfig, dict(gamma=2.0), "gamma must be an integer, got 2.0"),
    (SpeculativeConfig, dict(lenience=nan), "lenience must be a finite number, got nan"),
    (SpeculativeConfig, dict(adaptive_gamma="no"), "adaptive_gamma must be true or false, got 'no'"),
    (PromptLookupConfig, dict(num_draft_tokens=True), "num_draft_tokens must be an integer, got True"),
    (SamplingConfig, dict(top_k=-1), "top_k must be >= 0 (0 disables it), got -1"),
])
def test_bad_config_values_are_eagle_errors(cls, kwargs, message):
    with pytest.raises(EagleError) as error:
        cls(**kwargs)
    assert str(error.value) == message


def test_tree_options_are_checked_before_the_target_loads(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("eagle.engine.load_target", loaded)
    for kwargs, message in [(dict(total_tokens=0), "total_tokens must be >= 1"),
                            (dict(depth=nan), "depth must be an integer, got nan"),
                            (dict(top_k=True), "top_k must be an integer, got True"),
                            (dict(lookup_tokens=-1), "lookup_tokens must be >= 0"),
                            (dict(gamma="4"), "gamma must be an integer")]:
        with pytest.raises(EagleError, match=message):
            EagleModel.from_pretrained("smollm2-135m-instruct", **kwargs)


def test_model_specs_say_what_is_wrong(tmp_path):
    from eagle.runtime.target import check_spec

    (tmp_path / "empty").mkdir()
    (tmp_path / "a.txt").write_text("x")
    for spec, message in [(str(tmp_path / "nope"), f"model folder not found: {tmp_path / 'nope'}"),
                          ("./nope", "model folder not found: ./nope"),
                          ("nope", "unknown model spec 'nope': no such folder or file"),
                          (str(tmp_path / "x.gguf"), "GGUF file not found"),
                          (str(tmp_path / "empty"), f"{tmp_path / 'empty'} is a folder but holds no config.json"),
                          (str(tmp_path / "a.txt"), f"{tmp_path / 'a.txt'} is a file, not a model folder or a .gguf file"),
                          ("", "a model spec must be a non-empty string")]:
        with pytest.raises(EagleError) as error:
            check_spec(spec)
        assert str(error.value).startswith(message)
    assert check_spec("owner/name") == "hub" and check_spec("smollm2-135m-instruct") == "default"


# ---- training data -----------------------------------------------------------------------------
def chat_line(text: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "t3"}, {"role": "assistant", "content": text}]})


def test_training_data_that_is_not_utf8_or_malformed_is_one_line_with_file_and_line(tmp_path, capsys):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes((chat_line("t4") + "\n").encode() + chat_line("caf@").encode().replace(b"@", b"\xe9") + b"\n")
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text(chat_line("t4") + "\n\n" + '{"messages": [}\n')
    not_chat = tmp_path / "notchat.jsonl"
    not_chat.write_text(chat_line("t4") + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    array = tmp_path / "array.json"
    array.write_text("[\n" + chat_line("t4") + ",\n]\n")
    for path, message in [(latin1, f"{latin1}:2: not UTF-8 text (byte 0xe9 at column 87)"),
                          (malformed, f"{malformed}:3: not valid JSON (Expecting value, column 15)"),
                          (not_chat, f"{not_chat}:2: not a conversation (missing key 'content')"),
                          (array, f"{array}:3: not valid JSON (Expecting value, column 1)")]:
        # the data is read before the target loads: a target spec that cannot load shows it is not reached
        assert features.main(["--set", f"data={path}", "target=./not-reached", f"out_dir={tmp_path / 'f'}"]) == 2
        assert one_line(capsys.readouterr().err, "eagle-features") == message


# ---- an abandoned stream -----------------------------------------------------------------------
@pytest.mark.slow
def test_a_stream_dropped_half_way_leaves_no_error_at_exit():
    script = ("from tests.conftest import tiny_target, tiny_drafter\n"
              "from eagle.engine import EagleModel\n"
              "t = tiny_target()\n"
              "m = EagleModel(t, tiny_drafter(t), drafter_quant='none')\n"
              "pieces = iter(m.generate([1, 2, 3], method='eagle-tree', max_new_tokens=50, stream=True))\n"
              "print(next(pieces))\n"
              "ar = iter(m.generate([1, 2, 3], method='ar', max_new_tokens=50, stream=True))\n"
              "print(next(ar))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and proc.stdout.strip() and proc.stderr == "", proc.stderr


def test_a_closed_stream_stops_and_a_finished_one_has_its_result(target):
    model = EagleModel(target)
    with model.generate([1, 2, 3], max_new_tokens=20, stream=True) as stream:
        first = next(iter(stream))
    assert first and stream.result is None and list(stream) == []  # closed: nothing more
    stream = model.generate([1, 2, 3], max_new_tokens=20, stream=True)
    assert "".join(stream) == model.generate([1, 2, 3], max_new_tokens=20).text and stream.result is not None


def test_a_damaged_gguf_file_is_one_error(tmp_path):
    from eagle.runtime.target import load_target

    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)  # the magic, then garbage
    with pytest.raises(EagleError, match=f"^cannot read GGUF file {path}: "):
        load_target(str(path))
