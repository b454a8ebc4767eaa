"""The GPU window (scripts/gpu_train.sh -> scripts/gpu_train.py) rehearsed on the CPU with a tiny target and
tiny budgets: every user turn of cut-off ShareGPT conversations answered (multi-turn), both drafter kinds trained
on packed rows (one warm-started from a returned .tar), accepted length measured, and at most 8 returned files of
at most 16 MiB; and the carried ShareGPT file that --prepare-sharegpt makes."""

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

from gpu_train import prepare_sharegpt  # noqa: E402
from train.regenerate import chat_id, read_elements, user_turns  # noqa: E402


def test_prepare_sharegpt_keeps_system_and_user_turns_of_complete_distinct_conversations(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "system", "value": "be brief"}] * (i == 2) + [
        {"from": "human", "value": f"question {i % 5}"}, {"from": "gpt", "value": "answer"},
        {"from": "human", "value": f"more {i % 5}"}, {"from": "gpt", "value": "answer"}]} for i in range(8)]
    text = json.dumps(records)
    cut = tmp_path / "sharegpt.json"
    cut.write_text(text[: text.index('"id": "6"') + 3])  # cut inside the seventh record
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"prompt": "more  1", "category": "x"}) + "\n")
    dest = tmp_path / "carried" / "conversations.jsonl.gz"
    counts = prepare_sharegpt(str(cut), dest, exclude_prompts=str(bench))
    kept, bad, cut_short = read_elements(gzip.decompress(dest.read_bytes()).decode())
    assert (bad, cut_short) == (0, False)
    assert (counts["records"], counts["duplicates"], counts["excluded_benchmark"]) == (6, 1, 1)
    assert counts["conversations"] == len(kept) == 4 and counts["user_turns"] == 8
    assert [user_turns(r) for r in kept] == [(None, ["question 0", "more 0"]), ("be brief", ["question 2", "more 2"]),
                                             (None, ["question 3", "more 3"]), (None, ["question 4", "more 4"])]
    assert all(t["from"] != "gpt" for r in kept for t in r["conversations"])
    # what an earlier window answered is left out, then the first ``limit`` of the rest are kept
    answered = tmp_path / "answered"
    answered.mkdir()
    done = {"id": f"sg-{chat_id(None, ['question 3', 'more 3'])}", "conversations": []}
    (answered / "data.jsonl.gz").write_bytes(gzip.compress((json.dumps(done) + "\n").encode()))
    counts = prepare_sharegpt(str(cut), dest, exclude_prompts=str(bench), answered=answered, limit=2)
    kept = read_elements(gzip.decompress(dest.read_bytes()).decode())[0]
    assert counts["answered_before"] == 1 and counts["conversations"] == 2
    assert [user_turns(r)[1][0] for r in kept] == ["question 0", "question 2"]
    prepare_sharegpt(str(cut), dest, exclude_prompts=str(bench), answered=answered)
    assert [user_turns(r)[1][0] for r in read_elements(gzip.decompress(dest.read_bytes()).decode())[0]] == [
        "question 0", "question 2", "question 4"]


@pytest.mark.slow
def test_the_gpu_window_rehearsed_on_the_cpu(tmp_path):
    target_dir = save_tiny_chat_target(tmp_path / "target")
    chats = synthetic_chats(tmp_path / "chats.jsonl", n=40)
    questions = [{"conversations": [{"from": "human", "value": f"t{5 + i % 20} t{6 + i % 13} t9"},
                                    {"from": "gpt", "value": "t4"}, {"from": "human", "value": f"t{7 + i} t8"},
                                    {"from": "gpt", "value": "t4"}]} for i in range(12)]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps(questions)[:-30])  # cut off, as the carried file is
    (tmp_path / "bench.jsonl").write_text(json.dumps({"prompt": "t7 t8", "category": "x"}) + "\n")  # conversation 0
    target = load_target(str(target_dir), lean=False)
    warm = tmp_path / "warm"
    Drafter.from_target(target, draft_vocab_size=16, token_counts=None).save_pretrained(warm / "eagle-drafter")
    with tarfile.open(warm / "eagle-drafter.tar", "w") as tar:
        tar.add(warm / "eagle-drafter", arcname="eagle-drafter")
    users = [questions[1]["conversations"][0]["value"], questions[1]["conversations"][2]["value"]]
    earlier = {"id": f"sg-{chat_id(None, users)}", "source": "earlier", "conversations": [
        {"from": "human", "value": users[0]}, {"from": "gpt", "value": "t4 t5"},
        {"from": "human", "value": users[1]}, {"from": "gpt", "value": "t6"}]}
    (tmp_path / "resume").mkdir()  # an earlier window's returned data: continued, not answered again
    (tmp_path / "resume" / "data.jsonl.gz").write_bytes(gzip.compress((json.dumps(earlier) + "\n").encode()))
    out = tmp_path / "out"
    small = ["max_steps=6", "max_length=48", "draft_vocab_size=16"]
    env = {**os.environ, "OUT": str(out), "EAGLE_GPU_TARGET": str(target_dir), "EAGLE_GPU_SHAREGPT": str(sharegpt),
           "EAGLE_GPU_DEVICE": "cpu", "EAGLE_GPU_INIT_EAGLE": str(warm / "eagle-drafter.tar"),
           "EAGLE_GPU_TRAIN_WORK": str(tmp_path / "work"), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "EAGLE_GPU_RESUME_DATA": str(tmp_path / "resume")}
    # budgets far above what the work needs (a busy CPU is slow to start processes): steps bound the training
    args = ["--budget", "400", "--gen-s", "120", "--data", str(chats), "--dev-data", "heldout",
            "--set-data", "num_conversations=8", "answer_max_tokens=8", "rows=4", "context_tokens=96",
            "heldout_fraction=0.3", f"exclude_prompts={tmp_path / 'bench.jsonl'}", "--pack-tokens", "96",
            "--rows", "2", "--startup-s", "60",
            "--bench-s", "120", "--bench-prompts", str(tmp_path / "bench.jsonl"), "--bench-limit", "1",
            "--bench-new-tokens", "8", "--log-every", "1", "--lr", "3e-3", "--warmup-steps", "1",
            "--set-eagle3", *small, "--set-eagle", *small[:2]]
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "window.json").read_text())
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all((out / f).stat().st_size <= 16 << 20 for f in files)
    assert set(files) == {"window.json", "window.log", "eagle3-drafter.tar", "eagle-drafter.tar", "data.jsonl.gz",
                          "heldout.jsonl.gz"}
    data = report["data"]
    assert report["ok"] and data["rc"] == 0 and 0 < data["conversations"] and 0 < data["heldout"]
    assert data["source"]["source_cut_short"] and data["source"]["excluded_benchmark"] == 1
    back = {name: [json.loads(line) for line in gzip.decompress((out / f"{name}.jsonl.gz").read_bytes()).splitlines()]
            for name in ("data", "heldout")}
    assert (len(back["data"]), len(back["heldout"])) == (data["conversations"], data["heldout"])
    assert earlier in back["data"] and sum(r["id"] == earlier["id"] for r in back["data"] + back["heldout"]) == 1
    decoding = data["decoding"]
    assert decoding["attention"] == "sdpa" and decoding["steps"] > 0 and decoding["prefills"] > 0
    assert decoding["answer_tokens"] == data["generation"]["answer_tokens"] > 0
    turns = [[(t["from"], t["value"]) for t in r["conversations"]] for r in back["data"] + back["heldout"]]
    assert sum(sum(who == "gpt" for who, _ in t) for t in turns) == data["answers"]
    asked = {(q["conversations"][0]["value"], q["conversations"][2]["value"]) for q in questions}
    assert all((t[0][1], t[2][1]) in asked for t in turns if len(t) == 4)  # the source's user turns, in order
    assert any(len(t) == 4 and t[2][0] == "human" and t[1][0] == t[3][0] == "gpt" for t in turns)  # multi-turn
    assert report["data_files"][-1].endswith("data.jsonl") and report["dev_data"].endswith("heldout.jsonl")
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
