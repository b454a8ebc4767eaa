"""A short DeepSpeed run of the drafter trainer (``train/main.py``), its resume, and the trained
drafter loaded on the CPU: a smoke run of the whole training path on one device.

    python scripts/train_smoke.py --out DIR [--device cuda|cpu] [--target SPEC] [--steps 6] [--more 4]

ZeRO-2 (``configs/deepspeed/zero2.json``: torch's AdamW, nothing compiled), bf16 on CUDA (DeepSpeed's
``bf16`` section) and fp32 on a CPU, features computed on the fly (``online: true``) from
synthetic chats written here. Without ``--target`` the target is a tiny random Llama saved here
(word-level tokenizer, nothing downloaded); with one (e.g. a .gguf path), that target. The trainer
runs as one process with the rendezvous variables set (no launcher needed). Writes
``DIR/train-smoke.json``; exit status 0 when every check passed."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.launch import run_single  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}t2 {% else %}t3 {% endif %}"
                 "{{ m['content'] }} t0 {% endfor %}{% if add_generation_prompt %}t3 {% endif %}")
WORDS = ("the sea", "a quiet town", "the old bridge", "my neighbour", "the river", "a small boat", "the market",
         "the garden", "a long road", "the library")
VERBS = ("looks at", "walks past", "remembers", "describes", "paints", "visits", "listens to", "follows")


def tiny_target(path: Path) -> str:
    """A random Llama (vocabulary t0..t63, t0 the EOS) with a chat template, saved to ``path``."""
    import torch
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(64)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=AddedToken("t1", single_word=True),
                                        eos_token=AddedToken("t0", single_word=True))
    tokenizer.chat_template = CHAT_TEMPLATE
    cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               initializer_range=0.3, tie_word_embeddings=True, eos_token_id=0, bos_token_id=None,
                               pad_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def chats(path: Path, tiny: bool, n: int = 64) -> None:
    """``n`` synthetic conversations (ShareGPT layout): word ids counting up for the tiny target,
    short English sentences for a real one."""
    rng = random.Random(0)
    lines = []
    for _ in range(n):
        if tiny:
            start = rng.randint(4, 40)
            question = " ".join(f"t{rng.randint(4, 63)}" for _ in range(rng.randint(2, 6)))
            answer = " ".join(f"t{4 + (start + i) % 60}" for i in range(rng.randint(8, 20)))
        else:
            subject, verb, obj = rng.choice(WORDS), rng.choice(VERBS), rng.choice(WORDS)
            question = f"Write two sentences about how {subject} {verb} {obj}."
            answer = " ".join(f"{rng.choice(WORDS).capitalize()} {rng.choice(VERBS)} {rng.choice(WORDS)}."
                              for _ in range(rng.randint(3, 6)))
        lines.append(json.dumps({"conversations": [{"from": "human", "value": question},
                                                   {"from": "gpt", "value": answer}]}))
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when present")
    parser.add_argument("--target", help="target spec (default: a tiny random Llama made here)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--more", type=int, default=4, help="steps of the resumed run")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per trainer run")
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": device, "steps": args.steps, "more": args.more, "checks": {}}
    checks = report["checks"]
    start = time.time()
    target = args.target or tiny_target(out / "target")
    data = out / "chats.jsonl"
    chats(data, tiny=args.target is None)
    ds = json.loads((ROOT / "configs" / "deepspeed" / "zero2.json").read_text())
    ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] = 2, 1
    ds["optimizer"]["params"].update(lr=1e-3, torch_adam=True)
    ds["scheduler"]["params"].update(warmup_max_lr=1e-3, warmup_num_steps=1)
    ds["bf16"] = {"enabled": device == "cuda"}
    (out / "ds.json").write_text(json.dumps(ds, indent=2))
    run_dir = out / "run"
    base = {"target": target, "data": str(data), "online": True, "max_length": 256,
            "drafter_config": str(ROOT / "configs" / "drafter" / "eagle1.json"), "deepspeed_config": str(out / "ds.json"),
            "out_dir": str(run_dir), "epochs": 1000, "log_every": 1, "eval_every": 100000,
            "save_every": args.steps, "eval_fraction": 0.1, "report_to": "none"}
    if device == "cpu" and not torch.cuda.is_available():
        pass  # the trainer picks the CPU itself
    elif device == "cpu":
        print("train_smoke: --device cpu on a machine with CUDA runs the trainer on CUDA anyway", file=sys.stderr)
    import yaml

    first = out / "first.yaml"
    first.write_text(yaml.safe_dump({**base, "max_steps": args.steps}))
    code, rows = run_single(first, out / "first.log", args.timeout)
    losses = [r["loss"] for r in rows if "loss" in r]
    checks["first_run_exit_0"] = code == 0
    checks["losses_finite"] = bool(losses) and all(l == l and abs(l) < 1e6 for l in losses)
    latest = run_dir / "checkpoints" / "latest"
    checks["checkpoint_written"] = latest.is_file() and latest.read_text().strip() == f"step{args.steps}"
    report["first_losses"] = losses
    second = out / "second.yaml"
    second.write_text(yaml.safe_dump({**base, "max_steps": args.steps + args.more}))
    code, rows = run_single(second, out / "second.log", args.timeout)
    steps = [r["step"] for r in rows if "loss" in r]
    checks["resume_exit_0"] = code == 0
    checks["resumed_past_checkpoint"] = bool(steps) and steps[0] == args.steps + 1
    summary = run_dir / "summary.json"
    checks["summary_steps"] = summary.is_file() and json.loads(summary.read_text()).get("steps") == args.steps + args.more
    report["resumed_losses"] = [r["loss"] for r in rows if "loss" in r]
    try:  # the trained drafter on the CPU, in float32: loads, and greedy tree decoding equals plain decoding
        from eagle.drafting.drafter import Drafter
        from eagle.engine import EagleModel
        from eagle.runtime.target import load_target

        cpu_target = load_target(target, device="cpu", dtype=torch.float32)
        drafter = Drafter.from_pretrained(run_dir / "drafter", target=cpu_target)
        checks["drafter_loads_on_cpu"] = next(drafter.parameters()).device.type == "cpu"
        model = EagleModel.from_pretrained(cpu_target, drafter=drafter, total_tokens=8, depth=3)
        prompt = "t5 t9 t12" if args.target is None else "Write two sentences about the sea."
        ar = model.generate(prompt, method="ar", max_new_tokens=16)
        tree = model.generate(prompt, method="eagle-tree", max_new_tokens=16)
        checks["cpu_tree_equals_ar"] = tree.token_ids == ar.token_ids
        report["cpu_accept_length"] = tree.mean_accept_length
    except Exception as exc:  # reported, not raised: the summary is written either way
        checks["drafter_loads_on_cpu"] = False
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["ok"] = all(checks.values())
    report["wall_s"] = round(time.time() - start, 1)
    (out / "train-smoke.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
