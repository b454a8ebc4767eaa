"""The Qwen2.5-Coder recipe's steps end to end on a tiny Qwen2 GGUF target with a chat template: data (coding
turns answered by the target), features stored from the file's codes, a drafter trained on them, eagle-bench,
eagle-card, loading the drafter, and decoding identical to ``ar``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import train.main
from eagle import Drafter, EagleModel
from eagle.runtime.gguf_weights import GGUFModel
from eagle.runtime.target import load_target

from tests.runtime.test_gguf_weights import kernels_or_skip, write_model_gguf

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "recipes" / "qwen2.5-coder-1.5b-instruct"
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = [" def", " return", " the", " print", "ing", " code", " function", " list", " python"]


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character standing for each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def bpe_tokenizer(words: list[str]):
    """(tokens, a function writing them to a GGUF file as a Qwen2 byte-level BPE tokenizer with ChatML): the 256
    bytes, merges spelling ``words``, then <|endoftext|>, <|im_start|>, <|im_end|> (the EOS)."""
    chars = byte_chars()
    tokens, merges = list(chars), []
    for word in words:
        spelled = "".join(chars[b] for b in word.encode())
        part = spelled[0]
        for ch in spelled[1:]:
            if part + ch not in tokens:
                merges.append(f"{part} {ch}")
                tokens.append(part + ch)
            part += ch
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * len(tokens) + [3] * len(specials)
    tokens = tokens + specials

    def write(writer) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_pad_token_id(tokens.index("<|endoftext|>"))
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHATML)

    return tokens, write


def write_chat_gguf(path: Path) -> Path:
    """A tiny random Qwen2 (4 layers, q/k/v biases, tied embedding) with a byte-level BPE tokenizer and ChatML,
    its matrices Q8_0 codes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokens, tokenizer = bpe_tokenizer(WORDS)
    cfg = Qwen2Config(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=len(tokens) - 1, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
    return write_model_gguf(path, model, dict.fromkeys(names, "Q8_0"), metadata=tokenizer)


CODING = ["Write a python function that returns the list reversed.", "How do I print a dict in python?",
          "Fix this code: def f(x) return x", "What does the function zip do in python?",
          "```\nprint(1)\n```\nWhy does this print 1?", "Write code that sums a list.",
          "Explain recursion with a python function.", "How do I sort a list of tuples in python?",
          "Write a function that checks if a string is a palindrome.", "What is a python list comprehension?"]
OTHER = ["Plan a trip to Rome.", "What is a good name for a cat?", "Tell me a joke."]


def sharegpt_file(path: Path) -> Path:
    """A ShareGPT JSON array: coding requests and others, the original answers (which the recipe drops)."""
    records = [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "old"}]}
               for i, q in enumerate(CODING + OTHER)]
    path.write_text(json.dumps(records))
    return path


def environment(tmp_path: Path) -> dict:
    """rank 0 of 1 as the deepspeed launcher sets it, on the CPU, this checkout first on the path."""
    import os
    import random

    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled",
            "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(29500 + random.randint(0, 2000)),
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.mark.slow
def test_the_coder_recipe_runs_end_to_end_on_a_tiny_gguf_target(tmp_path, monkeypatch):
    from infer.bench import main as bench_main
    from infer.cli import main as generate_main
    from train.card import main as card_main
    from train.features import main as features_main
    from train.selfdistill import main as selfdistill_main

    kernels_or_skip()
    monkeypatch.chdir(ROOT)  # the recipe's paths are relative to the repository root
    gguf = write_chat_gguf(tmp_path / "tiny-coder.gguf")
    data, run = tmp_path / "data", tmp_path / "run"
    # alternative step 1: the target answers the coding turns of a small ShareGPT file (sharegpt.yaml)
    selfdistill_main(["--config", str(RECIPE / "sharegpt.yaml"), "--set", f"target={gguf}",
                      f"source={sharegpt_file(tmp_path / 'sharegpt.json')}", f"out_dir={data}",
                      "answer_max_tokens=24", "context_tokens=160", "rows=2", "heldout_fraction=0.0", "max_wall_s=0"])
    stats = json.loads((data / "stats.json").read_text())
    assert stats["source"]["not_coding"] == len(OTHER) and stats["written"]["train"] == len(CODING)
    chats = [json.loads(line) for line in (data / "data.jsonl").read_text().splitlines()]
    assert {c["conversations"][0]["value"] for c in chats} == set(CODING)
    assert all(c["conversations"][1]["value"] != "old" for c in chats)  # the target's own answers
    # alternative step 2: step 2's config on those chats, stored once from the lean forward over the file's codes
    features = tmp_path / "features"
    features_main(["--config", str(RECIPE / "features-answers.yaml"), "--set", f"target={gguf}",
                   "--set", f"data={data / 'data.jsonl'}", "--set", f"out_dir={features}", "--set", "max_length=128"])
    assert json.loads((features / "manifest.json").read_text())["num_examples"] == len(CODING)
    # steps 1 and 2: the same coding conversations with the source's own answers, and their features
    kept = tmp_path / "kept"
    selfdistill_main(["--config", str(RECIPE / "sharegpt-answers.yaml"), "--set", f"target={gguf}",
                      f"source={tmp_path / 'sharegpt.json'}", f"out_dir={kept}", "heldout_fraction=0.0"])
    assert [json.loads(line)["conversations"][1]["value"] for line in (kept / "data.jsonl").read_text().splitlines()
            ] == ["old"] * len(CODING)
    features_b = tmp_path / "features-b"
    features_main(["--config", str(RECIPE / "features-answers.yaml"), "--set", f"target={gguf}",
                   "--set", f"data={kept / 'data.jsonl'}", "--set", f"out_dir={features_b}", "--set", "max_length=128"])
    assert json.loads((features_b / "manifest.json").read_text())["num_examples"] == len(CODING)
    # 3. the drafter: train.yaml on both folders' features, a few steps, rows and vocabulary for a tiny target
    train_yaml = yaml.safe_load((RECIPE / "train.yaml").read_text())
    assert train_yaml["features"] and train_yaml["layer_from_target"] is None and train_yaml["pack_tokens"]
    overrides = [f"target={gguf}", f"features=[{features}, {features_b}]", f"dev_data={data / 'data.jsonl'}",
                 f"out_dir={run}", "draft_vocab_size=96", "max_length=128",
                 "pack_tokens=128", "max_steps=3", "save_every=1", "max_wall_s=0", "eval_fraction=0.1",
                 "report_to=none"]
    proc = subprocess.run([sys.executable, train.main.__file__, "--config", str(RECIPE / "train.yaml"),
                           *(a for o in overrides for a in ("--set", o))], capture_output=True, text=True,
                          env=environment(tmp_path), timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["train_tokens"] > 0 and summary["train_examples"] > len(CODING)
    drafter_dir = run / "drafter"
    # 4. eagle-bench: ar, pld and eagle-tree with the drafter
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n"
                               for p, c in [("Write a python function that adds two numbers.", "coding"),
                                            ("Tell me about the sea.", "writing")]))
    bench = tmp_path / "bench.json"
    bench_main(["--prompts", str(prompts), "--target", str(gguf), "--drafter", str(drafter_dir), "--methods",
                "ar,pld,eagle-tree", "--max-new-tokens", "16", "--set", "warmup=0", "--json", str(bench)])
    methods = json.loads(bench.read_text())["methods"]
    assert methods["pld"]["identical_to_ar"] and methods["eagle-tree"]["identical_to_ar"]
    # 5. eagle-card writes the drafter's model card from the run's records
    card_main(["--drafter", str(drafter_dir), "--selfdistill", str(data / "stats.json"), str(kept / "stats.json"),
               "--features", str(features / "manifest.json"), str(features_b / "manifest.json"), "--summary",
               str(run / "summary.json"), "--bench", str(bench), "--train-config", str(RECIPE / "train.yaml")])
    card = (drafter_dir / "README.md").read_text()
    assert "eagle-tree" in card and "real user prompts" in card and "the source's own answers" in card
    # 6. the drafter loads for its target and decodes as ar
    target = load_target(str(gguf))
    assert isinstance(target.model, GGUFModel)
    drafter = Drafter.from_pretrained(drafter_dir, target=target)
    assert drafter.config.draft_vocab_size == 96 and drafter.config.num_layers == 1
    model = EagleModel.from_pretrained(target, drafter=drafter)
    for prompt in ("Write a python function that adds two numbers.", "How do I print a list?"):
        ar = model.generate(prompt, method="ar", max_new_tokens=20).token_ids
        assert model.generate(prompt, method="eagle-tree", max_new_tokens=20).token_ids == ar
    generate_main(["--target", str(gguf), "--drafter", str(drafter_dir), "--max-new-tokens", "8",
                   "Write a python function."])
