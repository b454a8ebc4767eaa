"""One GPU window that retrains the drafters: data, training of each drafter kind, accepted length.

    python scripts/gpu_train.py --out DIR [--target SPEC] [--budget 540] [--source FILE] [--init-eagle3 DIR] ...

1. Data: with ``--source`` (a ShareGPT/OpenAI .json/.jsonl(.gz), e.g. made by ``--prepare-sharegpt``)
   every user turn of its conversations is answered by the target, each given the regenerated
   conversation before it (``eagle-selfdistill`` with ``source``: ``train.regenerate``; keys from
   ``--set-data``), for at most ``--gen-s`` seconds (it stops itself: conversations under way keep the
   turns answered by then), continuing ``--resume-data``'s conversations; they are used
   (``data.jsonl``; ``heldout.jsonl`` is left out of training) with the ``--data`` chat files
   (default: the tracked ``data/*/data.jsonl.gz``).
2. Training: each kind of ``--kinds`` (``eagle3``, ``eagle``) in turn, online features on packed rows
   (``pack_tokens``), bf16 on CUDA, until its share of the time left (``max_wall_s``), warm-started from
   ``--init-eagle3`` / ``--init-eagle`` when given.
3. Accepted length: ``eagle-bench`` greedy (float32) on the dev prompts with the 60/6/10 tree
   (total_tokens 60, depth 6, tree top-k 10, no lookup), each new drafter and (for the default target) the
   shipped one of its kind, beside ``ar`` (tokens/s, speedups, CUDA graph captures and fallbacks).
4. ``--out`` gets at most 8 files of at most 15 MiB: ``window.json`` (the report), ``window.log``,
   ``<kind>-drafter.tar`` per kind (config and 8-bit block-coded weights, as shipped) and the
   conversations made in step 1 (``heldout.jsonl.gz``, ``data.jsonl.gz``, split into parts when larger).

Every step's whole output stays in ``--work``. Exit status 0 when the data step ran (stopped at its time
limit or not) and every kind trained and was measured."""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle.errors import read_text  # noqa: E402
from train.launch import run_single  # noqa: E402
from train.regenerate import benchmark_prompts, completed, read_elements, select_chats, sharegpt_path  # noqa: E402

RECIPE = ROOT / "configs" / "recipes" / "smollm2-135m-instruct"
TRACKED = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "data").glob("*/data.jsonl.gz"))
KINDS = ("eagle3", "eagle")
STOP_S = 10  # seconds the data step keeps for its rows under way to finish their turn and for writing
PIECE = 15 << 20  # bytes per returned file (the limit is 16 MiB)
SHIPPED = {"eagle3": "eagle3", "eagle": ""}  # eagle-bench's name of the shipped drafter of each kind


def log(message: str, path: Path) -> None:
    line = f"[{time.strftime('%H:%M:%S', time.gmtime())}] {message}"
    print(line, flush=True)
    with path.open("a") as f:
        f.write(line + "\n")


def prepare_sharegpt(source: str, dest: Path, exclude_prompts: str = "benchmarks/prompts",
                     answered: Path | None = None, limit: int = 0) -> dict:
    """The conversations of a ShareGPT/OpenAI file (or ``sharegpt``: the PyPI package's) that the data step
    would answer (deduplicated, none with a benchmark prompt of ``exclude_prompts``, none of the conversations
    in ``answered``: a folder of returned data, as ``--resume-data`` takes; the first ``limit``, 0 = all), system
    and user turns only, as a ShareGPT .jsonl.gz small enough to carry (``source=`` reads it); -> counts."""
    path = sharegpt_path() if source == "sharegpt" else Path(source)
    records, _, _ = read_elements(read_text(path))
    chats, stats = select_chats(records, benchmark_prompts(exclude_prompts), 0.0, 0)
    done = set()
    if answered is not None:  # complete lines only, as the data step keeps them
        done = {json.loads(line)["id"] for text in returned(answered).values()
                for line in text.decode().split("\n") if line.endswith("}")}
    chats = [chat for chat in chats if f"sg-{chat.id}" not in done][:limit or None]
    lines = []
    for chat in chats:
        turns = [{"from": "system", "value": chat.system}] if chat.system else []
        turns += [{"from": "human", "value": user} for user in chat.users]
        lines.append(json.dumps({"conversations": turns}, ensure_ascii=False) + "\n")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(gzip.compress("".join(lines).encode(), 9))
    return {"conversations": len(chats), "answered_before": len(done), "user_turns": sum(len(c.users) for c in chats),
            "bytes": dest.stat().st_size,
            "records": stats["records"], "duplicates": stats["duplicates"],
            "excluded_benchmark": stats["excluded_benchmark"]}


def data_keys(args, out_dir: Path) -> list[str]:
    """The data step's ``eagle-selfdistill --set`` items: the window's, replaced by ``--set-data``'s where it
    names the same key (``--set`` refuses a key given twice with different values)."""
    items = [f"source={args.source}", f"out_dir={out_dir}", f"target={args.target}", "num_conversations=30000",
             "answer_max_tokens=256", "rows=512", *args.set_data]
    return [f"{k}={v}" for k, v in dict(item.split("=", 1) for item in items).items()]


def returned(folder: Path) -> dict[str, bytes]:
    """An earlier window's returned conversations: ``data.jsonl`` (``data.jsonl.gz`` or its parts ``.00``,
    ``.01``, ...) and ``heldout.jsonl`` (``heldout.jsonl.gz``) -> their JSONL bytes, by name, for those
    present."""
    texts = {}
    for name in ("data.jsonl", "heldout.jsonl"):
        parts = sorted(folder.glob(f"{name}.gz.[0-9][0-9]")) or sorted(folder.glob(f"{name}.gz"))
        if parts:
            texts[name] = gzip.decompress(b"".join(p.read_bytes() for p in parts))
    return texts


def resume_data(folder: Path, out_dir: Path, target: str) -> int:
    """An earlier window's returned conversations (``returned``) into the data step's ``out_dir``,
    which then skips them and adds to them; -> conversations found."""
    out_dir.mkdir(parents=True, exist_ok=True)
    found = 0
    for name, text in returned(folder).items():
        (out_dir / name).write_bytes(text)
        found += len(completed(out_dir / name))
    stats = out_dir / "stats.json"
    if not stats.exists():
        stats.write_text(json.dumps({"target": target}))
    return found


def make_data(args, work: Path, logf: Path, deadline: float) -> dict:
    """Step 1: ``--source``'s conversations, every user turn answered by the target (``eagle-selfdistill``
    with ``source``: ``train.regenerate``), stopped after ``--gen-s`` seconds; the conversations complete
    by then are kept (``data.jsonl``, ``heldout.jsonl`` in ``work/data``)."""
    out_dir = work / "data"
    if args.resume_data:
        log(f"data: continuing {resume_data(Path(args.resume_data), out_dir, args.target)} conversations "
            f"of {args.resume_data}", logf)
    limit = max(1, min(args.gen_s, deadline - time.time()))
    # the step stops itself (conversations under way keep the turns answered by then); the kill is a backstop
    keys = data_keys(args, out_dir) + ([] if any(k.startswith("max_wall_s=") for k in args.set_data) else
                                       [f"max_wall_s={max(1.0, limit - STOP_S):.0f}"])
    cmd = [sys.executable, "-m", "train.selfdistill", "--set", *keys]
    log(f"data: answering {args.source} for at most {limit:.0f}s: {' '.join(cmd[2:])}", logf)
    t0 = time.time()
    with (work / "selfdistill.txt").open("w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=limit + 60).returncode
        except subprocess.TimeoutExpired:
            rc = 124  # the step did not stop itself: the conversations written by then are kept
    took = time.time() - t0
    train, heldout = completed(out_dir / "data.jsonl"), completed(out_dir / "heldout.jsonl")
    answers = sum(1 for r in train + heldout for t in r["conversations"] if t["from"] == "gpt")
    stats_path = out_dir / "stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    decoding = stats.get("this_run", {})
    log(f"data: {len(train)} + {len(heldout)} held-out conversations, {answers} answers in {took:.0f}s (rc {rc}); "
        f"this run {decoding.get('answer_tokens')} answer tokens, {decoding.get('tokens_per_s')} tokens/s "
        f"({decoding.get('tokens_per_step_s')} over decode steps, attention {decoding.get('attention')})", logf)
    return {"conversations": len(train), "heldout": len(heldout), "answers": answers, "seconds": round(took, 1),
            "rc": rc, "source": stats.get("source"), "generation": stats.get("generation"), "decoding": decoding,
            "file": str(out_dir / "data.jsonl") if train else None,
            "heldout_file": str(out_dir / "heldout.jsonl") if heldout else None}


def ds_config(args, work: Path, kind: str) -> Path:
    """The DeepSpeed config of a kind's run: the GPU recipe's optimizer, ``--rows`` packed rows per micro-batch."""
    ds = json.loads((RECIPE / "deepspeed-gpu.json").read_text())
    ds["train_micro_batch_size_per_gpu"] = args.rows
    lr = args.lr
    ds["optimizer"]["params"]["lr"] = lr
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                        "warmup_num_steps": args.warmup_steps}}
    path = work / f"{kind}-ds.json"
    path.write_text(json.dumps(ds, indent=2))
    return path


def train_config(args, kind: str, data: list[str], work: Path, wall_s: float) -> dict:
    """A kind's TrainConfig keys: the recipe's loss settings, online features on packed rows,
    ``wall_s`` seconds of training, a warm start when carried in."""
    import yaml

    if kind == "eagle3":
        base = yaml.safe_load((RECIPE / "eagle3.yaml").read_text())
        keep = ("drafter_config", "draft_vocab_size", "noise", "ce_weight", "feature_weight", "unroll_steps",
                "unroll_decay", "max_length")
    else:
        base = yaml.safe_load((RECIPE / "train.yaml").read_text())
        keep = ("drafter_config", "draft_vocab_size", "noise", "ce_weight", "unroll_steps", "max_length")
    cfg = {k: base[k] for k in keep if k in base}
    cfg.update(target=args.target, online=True, data=data, pack_tokens=args.pack_tokens,
               deepspeed_config=str(ds_config(args, work, kind)), out_dir=str(work / kind), epochs=1000,
               max_wall_s=round(wall_s, 1), save_every=args.save_every, keep_last=1, eval_every=10 ** 9,
               eval_fraction=0.01, log_every=args.log_every, autocast="bf16", report_to="none")
    if args.dev_data:
        cfg["dev_data"] = args.dev_data
    init = getattr(args, f"init_{kind}")
    if init:  # the warm start keeps its architecture and draft vocabulary
        cfg.update(init_from=init, draft_vocab_size=0)
    elif cfg.get("draft_vocab_size"):
        cfg["draft_vocab_data"] = data  # the draft vocabulary: the most frequent answer tokens of this data
    for item in getattr(args, f"set_{kind}"):
        key, _, value = item.partition("=")
        cfg[key] = yaml.safe_load(value)
    return cfg


def pack_drafter(folder: Path, tar_path: Path) -> int:
    """A trained drafter folder -> a tar of its config and its weights as 8-bit block codes (as
    shipped, ``eagle.runtime.quant_blocks.pack_state``); -> bytes written."""
    from safetensors.torch import load_file, save

    from eagle.drafting.drafter import FORMAT
    from eagle.runtime.quant_blocks import pack_state

    weights = save(pack_state(load_file(str(folder / "model.safetensors"))), metadata={"format": FORMAT})
    with tarfile.open(tar_path, "w") as tar:
        for name, blob in (("config.json", (folder / "config.json").read_bytes()), ("model.safetensors", weights)):
            info = tarfile.TarInfo(f"{tar_path.stem}/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return tar_path.stat().st_size


def return_data(answers: Path, out: Path, max_parts: int) -> list[str]:
    """A JSONL file of the data step, gzipped, as ``<name>.gz`` or (larger than one returned file) parts
    ``<name>.gz.00``, ``.01``, ... to concatenate; at most ``max_parts`` (lines past them dropped)."""
    blob = gzip.compress(answers.read_bytes(), compresslevel=9)
    if len(blob) > PIECE * max_parts:  # keep the first lines that fit
        lines = answers.read_bytes().splitlines(keepends=True)
        while len(blob) > PIECE * max_parts and lines:
            lines = lines[: int(len(lines) * PIECE * max_parts / len(blob) * 0.97)]
            blob = gzip.compress(b"".join(lines), compresslevel=9)
    name = answers.name + ".gz"
    if len(blob) <= PIECE:
        (out / name).write_bytes(blob)
        return [name]
    names = []
    for i in range(0, len(blob), PIECE):
        names.append(f"{name}.{i // PIECE:02d}")
        (out / names[-1]).write_bytes(blob[i:i + PIECE])
    return names


def bench(args, drafters: dict[str, Path], work: Path, logf: Path, limit: float) -> dict:
    """Step 3: greedy eagle-bench, 60/6/10 tree, no lookup: each new drafter and the shipped ones."""
    methods = ["ar", *(f"eagle-tree@{folder}" for folder in drafters.values())]  # ar: the speed reference
    names = {f"eagle-tree@{folder}": f"new-{kind}" for kind, folder in drafters.items()}
    if args.baselines:
        for kind in drafters:
            method = f"eagle-tree@{SHIPPED[kind]}" if SHIPPED[kind] else "eagle-tree"
            methods.append(method)
            names[method] = f"shipped-{kind}"
    report = work / "bench.json"
    cmd = [sys.executable, "-m", "infer.bench", "--target", args.target, "--prompts", args.bench_prompts,
           "--methods", ",".join(methods), "--limit", str(args.bench_limit), "--max-new-tokens",
           str(args.bench_new_tokens), "--total-tokens", "60", "--set", "depth=6", "--set", "top_k=10",
           "--set", "lookup_tokens=0", "--temperature", "0", "--device", args.device, "--dtype", "float32", "--set",
           "warmup=0",
           "--json", str(report)]
    log(f"bench: {' '.join(cmd[2:])}", logf)
    with (work / "bench.txt").open("w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=max(1, limit)).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    if rc != 0 or not report.is_file():
        log(f"bench: failed (rc {rc}); see {work / 'bench.txt'}", logf)
        return {"rc": rc}
    data = json.loads(report.read_text())
    result = {"rc": rc, "prompts": data["prompts"], "machine": data["machine"]}
    for method, stats in data["methods"].items():
        result[names.get(method, method)] = {k: stats.get(k) for k in ("mean_accept_length", "tokens_per_second",
                                                                      "speedup_vs_ar", "identical_to_ar")}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="what comes back (at most 8 files)")
    parser.add_argument("--work", default="/tmp/gpu-train-work", help="every step's whole output")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--budget", type=float, default=540, help="seconds for everything")
    parser.add_argument("--kinds", default="eagle3,eagle", help="drafter kinds to train, in this order")
    parser.add_argument("--eagle3-share", type=float, default=0.6, help="eagle3's share of the training time")
    parser.add_argument("--source", help="conversations whose user turns the target answers (eagle-selfdistill's "
                                         "source: a ShareGPT/OpenAI .json/.jsonl(.gz), or sharegpt)")
    parser.add_argument("--set-data", nargs="*", default=[], metavar="KEY=VALUE",
                        help="eagle-selfdistill keys of the data step (default num_conversations=30000 "
                             "answer_max_tokens=256 rows=512)")
    parser.add_argument("--gen-s", type=float, default=120, help="seconds of answering at most")
    parser.add_argument("--resume-data", default="",
                        help="a folder with an earlier window's returned data.jsonl.gz (or parts) and heldout.jsonl.gz: "
                             "the data step continues them (their conversations skipped, their records kept)")
    parser.add_argument("--data", nargs="*", default=TRACKED, help="chat files trained on besides the data step's")
    parser.add_argument("--dev-data", default="data/dev-smollm2-greedy.jsonl",
                        help="chats the trainers evaluate on: a file, heldout (the data step's held-out "
                             "conversations) or '' (none)")
    parser.add_argument("--init-eagle3", default="", help="warm start: an eagle3 drafter folder")
    parser.add_argument("--init-eagle", default="", help="warm start: an eagle drafter folder")
    parser.add_argument("--set-eagle3", nargs="*", default=[], metavar="KEY=VALUE", help="train config overrides")
    parser.add_argument("--set-eagle", nargs="*", default=[], metavar="KEY=VALUE", help="train config overrides")
    parser.add_argument("--pack-tokens", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--rows", type=int, default=8, help="packed rows per micro-batch")
    parser.add_argument("--lr", type=float, default=8e-4)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=500)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--startup-s", type=float, default=60, help="seconds allowed a trainer to start and finish")
    parser.add_argument("--bench-s", type=float, default=90, help="seconds kept for the benchmark")
    parser.add_argument("--bench-prompts", default="benchmarks/prompts/dev.jsonl")
    parser.add_argument("--bench-limit", type=int, default=10)
    parser.add_argument("--bench-new-tokens", type=int, default=128)
    parser.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure the shipped drafters (default: for the default target)")
    parser.add_argument("--prepare-sharegpt", metavar="DEST",
                        help="instead: write --source's conversations, system and user turns, to DEST (.jsonl.gz, "
                             "small enough to carry)")
    parser.add_argument("--prepare-limit", type=int, default=0,
                        help="with --prepare-sharegpt: the first N conversations not in --resume-data (0 = all)")
    args = parser.parse_args(argv)
    if args.prepare_sharegpt:
        if not args.source:
            parser.error("--prepare-sharegpt needs --source")
        print(json.dumps(prepare_sharegpt(args.source, Path(args.prepare_sharegpt),
                                          answered=Path(args.resume_data) if args.resume_data else None,
                                          limit=args.prepare_limit)))
        return 0
    import torch

    start = time.time()
    deadline = start + args.budget
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.baselines is None:
        args.baselines = args.target == "smollm2-135m-instruct"
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kind(s) {', '.join(unknown)}: choose from {', '.join(KINDS)}")
    out, work = Path(args.out).resolve(), Path(args.work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    logf = out / "window.log"
    logf.write_text("")
    import yaml

    report: dict = {"device": args.device, "target": args.target, "budget_s": args.budget, "kinds": {},
                    "args": {k: v for k, v in vars(args).items()}}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    log(f"window: {args.device} {report.get('gpu', '')}, budget {args.budget:.0f}s, kinds {kinds}", logf)
    data = list(args.data)
    if args.source:
        made = make_data(args, work, logf, deadline - args.bench_s - len(kinds) * args.startup_s - 30)
        report["data"] = made
        if made["file"]:
            data.append(made["file"])
    if args.dev_data == "heldout":
        args.dev_data = report.get("data", {}).get("heldout_file") or ""
        log(f"dev data: {args.dev_data or 'none (no held-out conversations)'}", logf)
    report["data_files"], report["dev_data"] = data, args.dev_data
    drafters: dict[str, Path] = {}
    for n, kind in enumerate(kinds):
        left = deadline - time.time() - args.bench_s - (len(kinds) - n) * args.startup_s
        share = args.eagle3_share if (kind == "eagle3" and len(kinds) > 1) else 1.0 / (len(kinds) - n)
        wall = max(1.0, left * share)
        cfg = train_config(args, kind, data, work, wall)
        path = work / f"{kind}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log(f"train {kind}: {wall:.0f}s of training (config {path})", logf)
        t0 = time.time()
        code, rows = run_single(path, work / f"{kind}.txt", wall + args.startup_s + 60)
        summary_path = work / kind / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        entry = {"rc": code, "seconds": round(time.time() - t0, 1), "train_s_budget": round(wall, 1)}
        entry.update({k: summary.get(k) for k in ("steps", "epochs", "train_tokens", "tokens_per_s", "run_wall_s",
                                                   "train_examples", "eval")})
        entry["curve"] = summary.get("curve") or [r for r in rows if "loss" in r or "eval" in r]
        report["kinds"][kind] = entry
        log(f"train {kind}: rc {code}, {entry.get('steps')} steps, {entry.get('tokens_per_s') or 0:.0f} tokens/s, "
            f"{entry['seconds']:.0f}s", logf)
        if (work / kind / "drafter" / "model.safetensors").is_file():
            drafters[kind] = work / kind / "drafter"
    if drafters:
        report["bench"] = bench(args, drafters, work, logf, max(args.bench_s, deadline - time.time()))
        for kind in drafters:
            new, old = report["bench"].get(f"new-{kind}", {}), report["bench"].get(f"shipped-{kind}", {})
            report["kinds"][kind]["accept_length"] = new.get("mean_accept_length")
            report["kinds"][kind]["shipped_accept_length"] = old.get("mean_accept_length")
    files = ["window.json", "window.log"]
    for kind, folder in drafters.items():
        size = pack_drafter(folder, out / f"{kind}-drafter.tar")
        report["kinds"][kind]["returned_bytes"] = size
        files.append(f"{kind}-drafter.tar")
    returned = []
    for key in ("heldout_file", "file"):  # the small held-out file first: the training data may take parts
        if report.get("data", {}).get(key):
            returned += return_data(Path(report["data"][key]), out, 8 - len(files) - len(returned))
    if returned:
        report["data"]["returned"] = returned
    report["wall_s"] = round(time.time() - start, 1)
    report["ok"] = (report.get("data", {}).get("rc", 0) in (0, 124) and bool(kinds)
                    and all(report["kinds"].get(k, {}).get("rc") == 0 for k in kinds)
                    and all(report["kinds"][k].get("accept_length") for k in kinds))
    (out / "window.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"window done in {report['wall_s']:.0f}s, ok {report['ok']}: {out / 'window.json'}", logf)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
