"""The GPU window (scripts/gpu_train.sh -> scripts/gpu_train.py) rehearsed on the CPU with a tiny target and
tiny budgets: ShareGPT prompts answered, both drafter kinds trained on packed rows (one warm-started from a
returned .tar), accepted length measured, and at most 8 returned files of at most 16 MiB."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from eagle import Drafter
from eagle.runtime.target import load_target
from tests.train.test_train import save_tiny_chat_target, synthetic_chats

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_train import sharegpt_prompts  # noqa: E402


def test_sharegpt_prompts_read_a_cut_off_array_and_skip_excluded(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i % 5}"},
                                                {"from": "gpt", "value": "answer"}]} for i in range(8)]
    text = json.dumps(records)
    cut = tmp_path / "sharegpt.json"
    cut.write_text(text[: text.index('"id": "6"') + 3])  # cut inside the seventh record
    prompts = sharegpt_prompts(cut, 10, exclude={"question 1"})
    assert [p["prompt"] for p in prompts] == ["question 0", "question 2", "question 3", "question 4"]
    assert len(sharegpt_prompts(cut, 2, exclude=set())) == 2


@pytest.mark.slow
def test_the_gpu_window_rehearsed_on_the_cpu(tmp_path):
    target_dir = save_tiny_chat_target(tmp_path / "target")
    chats = synthetic_chats(tmp_path / "chats.jsonl", n=40)
    questions = [{"conversations": [{"from": "human", "value": f"t{5 + i % 20} t{6 + i % 13} t9"},
                                    {"from": "gpt", "value": "t4"}]} for i in range(12)]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps(questions)[:-30])  # cut off, as the carried file is
    (tmp_path / "bench.jsonl").write_text(json.dumps({"prompt": "t5 t6 t7", "category": "x"}) + "\n")
    target = load_target(str(target_dir), lean=False)
    warm = tmp_path / "warm"
    Drafter.from_target(target, draft_vocab_size=16, token_counts=None).save_pretrained(warm / "eagle-drafter")
    with tarfile.open(warm / "eagle-drafter.tar", "w") as tar:
        tar.add(warm / "eagle-drafter", arcname="eagle-drafter")
    out = tmp_path / "out"
    small = ["max_steps=6", "max_length=48", "draft_vocab_size=16"]
    env = {**os.environ, "OUT": str(out), "EAGLE_GPU_TARGET": str(target_dir), "EAGLE_GPU_SHAREGPT": str(sharegpt),
           "EAGLE_GPU_DEVICE": "cpu", "EAGLE_GPU_INIT_EAGLE": str(warm / "eagle-drafter.tar"),
           "EAGLE_GPU_TRAIN_WORK": str(tmp_path / "work"), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    # budgets far above what the work needs (a busy CPU is slow to start processes): steps bound the training
    args = ["--budget", "400", "--gen-s", "120", "--prompts", "8", "--answer-tokens", "8", "--gen-batch", "4",
            "--data", str(chats), "--dev-data", "", "--pack-tokens", "96", "--rows", "2", "--startup-s", "60",
            "--bench-s", "120", "--bench-prompts", str(tmp_path / "bench.jsonl"), "--bench-limit", "1",
            "--bench-new-tokens", "8", "--log-every", "1", "--lr", "3e-3", "--warmup-steps", "1",
            "--set-eagle3", *small, "--set-eagle", *small[:2]]
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "window.json").read_text())
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all((out / f).stat().st_size <= 16 << 20 for f in files)
    assert set(files) == {"window.json", "window.log", "eagle3-drafter.tar", "eagle-drafter.tar", "data.jsonl.gz"}
    assert report["ok"] and 0 < report["data"]["answers"] <= 8
    answers = gzip.decompress((out / "data.jsonl.gz").read_bytes()).decode().splitlines()
    assert len(answers) == report["data"]["answers"] and json.loads(answers[0])["conversations"][0]["value"] == "t5 t6 t9"
    assert report["kinds"]["eagle"]["curve"] and report["kinds"]["eagle3"]["curve"]
    for kind in ("eagle3", "eagle"):
        entry = report["kinds"][kind]
        assert entry["steps"] == 6 and entry["tokens_per_s"] > 0 and entry["accept_length"] >= 1.0
        with tarfile.open(out / f"{kind}-drafter.tar") as tar:
            tar.extractall(tmp_path / "back", filter="data")
        drafter = Drafter.from_pretrained(tmp_path / "back" / f"{kind}-drafter", target=target)
        assert drafter.config.kind == kind
    config = (tmp_path / "work" / "eagle.yaml").read_text()
    assert "init_from" in config and "init/eagle-drafter" in config  # the warm start, unpacked from its .tar
