"""Training runs as users start them, on a tiny random target: ``eagle-train`` through the real
``deepspeed`` launcher (ZeRO-2, wandb offline), online features, and runs killed with SIGKILL
(at a random step; while a checkpoint is being written) then resumed."""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import train.main
from eagle import Drafter
from eagle.runtime.target import load_target
from train import checkpoint
from train.features import FeatureShards, FeaturesConfig, build
from train.main import TrainConfig, evaluate

from tests.conftest import tiny_target
from .test_train import CHAT_TEMPLATE, synthetic_chats

ROOT = Path(__file__).resolve().parents[2]


def save_target(path: Path) -> Path:
    """The tiny chat target of ``tests/train/test_train.py``, saved (its lean decoder, never used here, left unbuilt)."""
    tiny = tiny_target(seed=0, eos=True, vocab_size=32, tied=True, lean=False)
    tiny.tokenizer.chat_template = CHAT_TEMPLATE
    tiny.model.save_pretrained(path)
    tiny.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-runs")
    target_dir = save_target(root / "target")
    data = synthetic_chats(root / "chats.jsonl")
    features = build(FeaturesConfig(target=str(target_dir), data=str(data), out_dir=str(root / "features"),
                                    shard_size=16))
    return {"root": root, "target": target_dir, "data": data, "features": features}


def run_files(space, name: str, zero: str = "zero1", **overrides) -> tuple[Path, Path]:
    """A run YAML (and its DeepSpeed JSON: ``configs/deepspeed/<zero>.json`` at a learning rate
    that trains in a few steps) under ``space``; returns (yaml, out_dir)."""
    root, out = space["root"], space["root"] / name
    ds = json.loads((ROOT / "configs" / "deepspeed" / f"{zero}.json").read_text())
    ds["optimizer"]["params"]["lr"] = 3e-3
    ds["scheduler"]["params"].update(warmup_max_lr=3e-3, warmup_num_steps=2)
    ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] = 4, 1
    ds.update(overrides.pop("deepspeed", {}))
    (root / f"{name}-ds.json").write_text(json.dumps(ds))
    cfg = {"target": str(space["target"]), "features": str(space["features"]), "out_dir": str(out),
           "deepspeed_config": str(root / f"{name}-ds.json"), "epochs": 100, "log_every": 1, "eval_every": 1000,
           "save_every": 5, "eval_fraction": 0.1, "report_to": "none", **overrides}
    (root / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    return root / f"{name}.yaml", out


def environment(space) -> dict:
    """The trainer's environment: on the CPU (float32, so its evaluation can be recomputed exactly here),
    wandb offline, this checkout first on the path."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "offline",
            "WANDB_DIR": str(space["root"] / "wandb"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def port() -> str:
    return str(29500 + random.randint(0, 2000))


def deepspeed(script: str | Path, *args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "1", "--master_port", port(), str(script),
            *args]


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline wandb run file (``run-*.wandb``: wandb's LevelDB-style log of
    protobuf records, 32 KiB blocks of chunks with a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    raw = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert raw[:4] == b":W&B"
    pos, block, records, chunk = 7, 32768, [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(chunk)
            chunk = b""
    rows = []
    for data in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


@pytest.mark.slow
def test_eagle_train_runs_zero2_through_the_deepspeed_launcher_and_logs_to_wandb_offline(space):
    """The ``eagle-train`` entry point (``train.launch:main``) execs the ``deepspeed`` launcher, which
    starts the trainer; under ZeRO-2 it trains, checkpoints (the optimizer state saved by a stage-2
    engine) and logs every loss line to an offline wandb run."""
    cfg, out = run_files(space, "zero2", zero="zero2", max_steps=8, log_every=2, save_every=4, report_to="wandb")
    entry = "import sys; from train.launch import main; sys.exit(main())"  # what the eagle-train script runs
    proc = subprocess.run([sys.executable, "-c", entry, "--num_gpus", "1", "--master_port", port(), "--",
                           "--config", str(cfg)], capture_output=True, text=True, env=environment(space), timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = [row for row in json_lines(proc.stdout) if "loss" in row]
    assert [row["step"] for row in logs] == [2, 4, 6, 8] and logs[-1]["loss"] < logs[0]["loss"]
    optim = torch.load(out / "checkpoints" / "step8" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    assert optim["ds_config"]["zero_optimization"]["stage"] == 2
    assert checkpoint.verify(out / "checkpoints" / "step8") is None and checkpoint.read_latest(out / "checkpoints") == "step8"
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    history = wandb_history(run_dir)
    assert [(row["step"], row["loss"]) for row in history if "loss" in row] == [(r["step"], r["loss"]) for r in logs]
    assert any("eval/top1" in row for row in history) and (run_dir / "files" / "output.log").is_file()
    Drafter.from_pretrained(out / "drafter", target=load_target(str(space["target"]), lean=False))


def untrained_and_trained_eval(space, out: Path, cfg: TrainConfig) -> tuple[dict, dict]:
    """The held-out evaluation of the drafter a run starts from (same seed) and of the one it saved."""
    target = load_target(str(space["target"]), lean=False)
    dataset = (train.main.online_dataset(target, cfg.data, cfg.max_length, []) if cfg.online
               else FeatureShards(cfg.features, target))
    order = list(range(len(dataset)))
    random.Random(cfg.seed).shuffle(order)
    held_out = order[:max(1, int(len(order) * cfg.eval_fraction))]
    torch.manual_seed(cfg.seed)
    untrained = Drafter.from_target(target, **json.loads((ROOT / cfg.drafter_config).read_text())).float()
    trained = Drafter.from_pretrained(out / "drafter", target=target).float()
    return (evaluate(untrained, target, dataset, held_out, cfg.eval_chain_depth),
            evaluate(trained, target, dataset, held_out, cfg.eval_chain_depth))


@pytest.mark.slow
def test_training_on_online_features_learns_and_checkpoints(space):
    """``online: true``: features computed from the target during training. The loss falls, a
    checkpoint is published, and the held-out evaluation the run reports is that of the saved
    drafter, well above the untrained drafter's."""
    cfg_path, out = run_files(space, "online", features="", online=True, data=str(space["data"]), max_steps=150,
                              save_every=50, log_every=25)
    proc = subprocess.run(deepspeed(train.main.__file__, "--config", str(cfg_path)), capture_output=True, text=True,
                          env=environment(space), timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [row["loss"] for row in json_lines(proc.stdout) if "loss" in row]
    assert len(losses) == 6 and all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < 0.85 * losses[0]
    assert checkpoint.checkpoints(out / "checkpoints") == ["step150", "step100", "step50"]
    assert all(checkpoint.verify(out / "checkpoints" / name) is None for name in ("step50", "step100", "step150"))
    reported = json.loads((out / "summary.json").read_text())["eval"]
    before, after = untrained_and_trained_eval(space, out, train.main.load_config_file(TrainConfig, str(cfg_path)))
    assert after == pytest.approx(reported, abs=1e-9)
    assert after["top1"] > before["top1"] + 0.12
    assert after["chain5_accept_length"] > before["chain5_accept_length"] + 0.12


# The trainer with two seams a test can slow down or stop at.
HOOKED_MAIN = '''
import os, sys, time
import train.checkpoint, train.main

step_sleep = float(os.environ.get("TEST_STEP_SLEEP", "0"))
real_batches = train.main.iter_batches


def iter_batches(*args, **kwargs):
    time.sleep(step_sleep)
    return real_batches(*args, **kwargs)


real_place = train.checkpoint.place


def place(partial, dest):
    if os.environ.get("TEST_STOP_BEFORE_PUBLISHING"):  # the files are written; the rename has not happened
        print("STOPPED " + dest.name, flush=True)
        time.sleep(600)
    real_place(partial, dest)


train.main.iter_batches, train.checkpoint.place = iter_batches, place
sys.exit(train.main.main())
'''


def single_rank(space) -> dict:
    """The environment of rank 0 of 1 as the deepspeed launcher sets it (the trainer started directly)."""
    return {**environment(space), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port()}


def start(space, cfg: Path, **env: str) -> subprocess.Popen:
    script = space["root"] / "hooked_main.py"
    script.write_text(HOOKED_MAIN)
    return subprocess.Popen([sys.executable, str(script), "--config", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**single_rank(space), **env}, cwd=ROOT,
                            start_new_session=True)


def read_until(proc: subprocess.Popen, stop, timeout: float = 240) -> list[str]:
    """stdout lines until ``stop(line)`` (then SIGKILL to the trainer's process group) or the end."""
    lines, deadline = [], time.time() + timeout
    for line in proc.stdout:
        lines.append(line)
        if stop(line):
            os.killpg(proc.pid, signal.SIGKILL)
            break
        assert time.time() < deadline, "".join(lines[-20:])
    proc.wait(timeout=60)
    lines += proc.stdout.read().splitlines(keepends=True)
    return lines


def logged_steps(lines: list[str]) -> list[int]:
    return [row["step"] for row in json_lines("".join(lines)) if "loss" in row]


@pytest.mark.slow
def test_a_run_killed_at_a_random_step_and_while_checkpointing_resumes_to_the_same_end(space):
    total, every = 40, 5
    cfg, out = run_files(space, "killed", max_steps=total, save_every=every, keep_last=2)
    ckpt = out / "checkpoints"
    kill_step = random.Random().randint(every + 2, total - every - 2)
    # 1. SIGKILL at a random step after the first checkpoint
    proc = start(space, cfg, TEST_STEP_SLEEP="0.08")
    lines = read_until(proc, lambda line: line.startswith("{") and json.loads(line).get("step", 0) >= kill_step)
    assert proc.returncode == -signal.SIGKILL, f"kill at step {kill_step}: " + "".join(lines[-10:])
    reached = max(logged_steps(lines))
    latest = checkpoint.read_latest(ckpt)
    kept = checkpoint.step_of(latest)
    assert reached - every <= kept <= reached + 1, (kill_step, reached, latest)  # at most one save interval lost
    assert all(checkpoint.verify(ckpt / name) is None for name in checkpoint.checkpoints(ckpt))
    assert len(checkpoint.checkpoints(ckpt)) <= 3  # keep_last 2 (+1 when killed between publishing and pruning)
    # 2. resumed there; SIGKILL while the next checkpoint's files are written but not yet published
    proc = start(space, cfg, TEST_STOP_BEFORE_PUBLISHING="1")
    lines = read_until(proc, lambda line: line.startswith("STOPPED"))
    text = "".join(lines)
    assert f"resumed from step {kept} " in text and lines[-1].startswith("STOPPED step"), text[-2000:]
    stopped = int(lines[-1].split("step")[-1])
    assert logged_steps(lines)[0] == kept + 1 and stopped == (kept // every + 1) * every
    assert checkpoint.read_latest(ckpt) == latest and checkpoint.verify(ckpt / latest) is None  # untouched
    assert (ckpt / checkpoint.partial_tag(f"step{stopped}")).is_dir() and not (ckpt / f"step{stopped}").exists()
    Drafter.from_pretrained(out / "drafter")  # the drafter folder too is whole
    # 3. `latest` emptied as well: a one-line note, the newest intact checkpoint (the same one, unless the first
    # kill fell between publishing a checkpoint and pointing `latest` at it), and the run ends where it would have
    newest = checkpoint.checkpoints(ckpt)[0]
    assert checkpoint.verify(ckpt / newest) is None and checkpoint.step_of(newest) in (kept, kept + every)
    kept = checkpoint.step_of(newest)
    (ckpt / "latest").write_text("")
    proc = subprocess.run([sys.executable, train.main.__file__, "--config", str(cfg)], capture_output=True, text=True,
                          env=single_rank(space), timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"eagle-train: resuming from {ckpt / newest}; skipped: latest is empty" in proc.stderr
    assert "Traceback" not in proc.stderr and f"resumed from step {kept} " in proc.stdout
    steps = logged_steps(proc.stdout.splitlines(keepends=True))
    assert steps == list(range(kept + 1, total + 1))
    assert json.loads((out / "summary.json").read_text())["steps"] == total
    assert checkpoint.checkpoints(ckpt) == [f"step{total}", f"step{total - every}"]
    assert checkpoint.read_latest(ckpt) == f"step{total}" and not list(ckpt.glob("*.partial"))
    optim = torch.load(ckpt / f"step{total}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    adam_steps = {int(s["step"]) for s in optim["optimizer_state_dict"]["base_optimizer_state"]["state"].values()}
    assert adam_steps == {total}  # the optimizer state went on from the checkpoint, not from scratch


@pytest.mark.slow
def test_a_run_into_the_folder_of_another_run_is_refused_in_one_line_until_started_over(space):
    """A run folder knows what its checkpoints belong to: a run of another architecture into it is
    refused before it resumes from or prunes them; ``--start-over`` deletes them and starts at step 0."""
    cfg, out = run_files(space, "owned", max_steps=2, save_every=1, keep_last=1)

    def run(config: Path, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, train.main.__file__, "--config", str(config), *flags],
                              capture_output=True, text=True, env=single_rank(space), timeout=300, cwd=ROOT)

    proc = run(cfg)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = out / "checkpoints"
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    assert checkpoint.checkpoints(ckpt) == ["step2"]
    other, _ = run_files(space, "owned-deeper", out_dir=str(out), max_steps=2, save_every=1, keep_last=1, num_layers=2)
    proc = run(other)
    said = [line for line in proc.stderr.splitlines() if line.startswith("eagle-train:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert said == [f"eagle-train: error: {out} holds checkpoints of another run (architecture: num_layers 1 vs 2): "
                    f"choose another out_dir, or pass --start-over to delete them and start from step 0 there"]
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before
    proc = run(other, "--start-over")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" not in proc.stdout and logged_steps(proc.stdout.splitlines(keepends=True)) == [1, 2]
    assert json.loads((out / checkpoint.RUN).read_text())["architecture"]["num_layers"] == 2
    assert Drafter.from_pretrained(out / "drafter").config.num_layers == 2


def run_state(ckpt: Path) -> dict:
    """What a checkpoint holds of a run: the drafter's weights, the optimizer's state (Adam's moments and
    step), the scheduler's, and the trainer's own (step, epoch, position in the epoch, tokens, noise RNG)."""
    model = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)
    optim = torch.load(ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    base = optim["optimizer_state_dict"]["base_optimizer_state"]
    return {"module": model["module"], "lr_scheduler": model["lr_scheduler"],
            "adam": {k: v for k, v in base["state"].items()}, "groups": base["param_groups"],
            "client": {k: model[k] for k in ("step", "epoch", "micro_in_epoch", "tokens", "noise_rng")}}


def assert_same(a, b, where: str = "") -> None:
    """Nested dicts/lists of tensors and numbers equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
def test_a_stopped_run_resumes_to_the_state_of_an_uninterrupted_one(space):
    """A run stopped twice (once by max_steps, once by max_wall_s), each time resumed from its last
    checkpoint, ends with the weights, optimizer and scheduler state, step, epoch, position in the epoch
    and noise RNG state of the same run uninterrupted, bit for bit; the epoch boundary (step 11) lies
    between the stops and the end. The learning-rate schedule is fixed in the DeepSpeed config, so that
    max_steps only says where to stop."""
    total = 14
    schedule = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                                  "warmup_num_steps": 2, "total_num_steps": total}}}

    def run(cfg: Path, *sets: str) -> str:
        proc = subprocess.run([sys.executable, train.main.__file__, "--config", str(cfg), *sets], capture_output=True,
                              text=True, env=single_rank(space), timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    whole_cfg, whole = run_files(space, "whole", max_steps=total, save_every=100, noise=0.2, deepspeed=schedule)
    stopped_cfg, stopped = run_files(space, "stopped", max_steps=total, save_every=100, noise=0.2,
                                     deepspeed=schedule)
    run(whole_cfg)
    run(stopped_cfg, "--set", "max_steps=5")
    out = run(stopped_cfg, "--set", "max_wall_s=0.000001")  # stops (with a checkpoint) after its first step
    assert "resumed from step 5 " in out and checkpoint.read_latest(stopped / "checkpoints") == "step6"
    out = run(stopped_cfg)
    assert "resumed from step 6 " in out and logged_steps(out.splitlines(keepends=True)) == list(range(7, total + 1))
    a, b = (run_state(run_dir / "checkpoints" / f"step{total}") for run_dir in (whole, stopped))
    assert a["client"]["epoch"] == 1 and a["client"]["micro_in_epoch"] == total - 11
    assert_same(a, b)
    for run_dir in (whole, stopped):  # the drafters saved at the end are the checkpoints' weights
        drafter = Drafter.from_pretrained(run_dir / "drafter")
        assert_same(drafter.state_dict(), {k: v for k, v in a["module"].items() if k in drafter.state_dict()})
