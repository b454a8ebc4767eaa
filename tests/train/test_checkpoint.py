"""Crash-safe saving (eagle.atomic, Drafter.save_pretrained, train.checkpoint) without DeepSpeed:
a child process is killed (SIGKILL) before each file-system step of a save in turn, and what is
left must be the old version or the new one; corrupt checkpoints and bad ``latest`` files are
skipped with a message; old checkpoints are pruned."""

from __future__ import annotations

import builtins
import json
import io
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

import pytest
import safetensors.torch
import torch

import eagle.atomic
import train.main
from eagle import Drafter, EagleError
from eagle.config import load_config_file
from train import checkpoint
from train.main import TrainConfig

from tests.conftest import tiny_drafter, tiny_target


class _Pause(Exception):
    pass


def _instrument(monkeypatch, at: int, ready_fd: int) -> None:
    """In a forked child: before the ``at``-th file-system step of a save (and, for a safetensors
    write, also after writing half of the file) tell the parent and wait to be killed."""
    count = [0]

    def point() -> None:
        count[0] += 1
        if count[0] == at:
            os.write(ready_fd, b"p")
            time.sleep(60)
            os._exit(3)

    def wrap(owner, name):
        real = getattr(owner, name)

        def hooked(*args, **kwargs):
            point()
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, hooked)

    for owner, name in [(os, "rename"), (os, "replace"), (os, "fsync"), (os, "link"), (os, "mkdir"),
                        (os, "unlink"), (os, "rmdir"), (shutil, "rmtree"), (eagle.atomic, "_exchange")]:
        wrap(owner, name)
    real_open = io.open

    def opened(file, mode="r", *args, **kwargs):  # a file opened to write: before, and once it is truncated
        writes = any(c in mode for c in "wax+")
        if writes:
            point()
        handle = real_open(file, mode, *args, **kwargs)
        if writes:
            point()
        return handle
    monkeypatch.setattr(io, "open", opened)
    monkeypatch.setattr(builtins, "open", opened)
    real_save = safetensors.torch.save_file

    def half_written(tensors, filename, metadata=None):
        point()
        real_save(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])  # as if killed while writing
        point()
        Path(filename).write_bytes(data)
    monkeypatch.setattr(safetensors.torch, "save_file", half_written)


def kill_at_every_step(action: Callable[[], None], check: Callable[[], None], monkeypatch,
                       reset: Callable[[], None] = lambda: None) -> int:
    """From the state ``reset`` makes, run ``action`` in a forked child killed before its 1st, 2nd,
    ... file-system step; after each kill call ``check`` (what is on disk must be whole). Stops
    when the child finishes; returns the number of kill points."""
    for at in range(1, 200):
        reset()
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            os.close(read_fd)
            try:
                with monkeypatch.context() as mp:
                    _instrument(mp, at, write_fd)
                    action()
                os.write(write_fd, b"d")
            finally:
                os._exit(0)
        os.close(write_fd)
        said = os.read(read_fd, 1)
        os.close(read_fd)
        if said == b"p":
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        check()
        if said != b"p":
            assert said == b"d", f"the save failed in the child at kill point {at}"
            return at - 1
    raise AssertionError("the save never finished")


def same_weights(a: Drafter, b: Drafter) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.slow
def test_drafter_save_killed_at_any_step_leaves_the_old_or_the_new_drafter(tmp_path, monkeypatch):
    target = tiny_target(lean=False)
    old, new = tiny_drafter(target, seed=1).float(), tiny_drafter(target, seed=2).float()
    folder = tmp_path / "drafter"
    seen = []

    def reset() -> None:
        for path in tmp_path.iterdir():
            shutil.rmtree(path)
        old.save_pretrained(folder)
        (folder / "README.md").write_text("card")  # a model card written beside the weights is kept

    def check() -> None:
        loaded = Drafter.from_pretrained(folder)
        seen.append("new" if same_weights(loaded, new) else "old" if same_weights(loaded, old) else "mixed")
        assert seen[-1] != "mixed" and (folder / "README.md").read_text() == "card"

    points = kill_at_every_step(lambda: new.save_pretrained(folder), check, monkeypatch, reset)
    assert points >= 6 and seen[0] == "old" and seen[-1] == "new" and "mixed" not in seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # nothing left beside it
    new.save_pretrained(tmp_path / "fresh")  # a first save (no old folder) works too
    assert same_weights(Drafter.from_pretrained(tmp_path / "fresh"), new)


@pytest.mark.slow
def test_a_folder_save_killed_at_any_step_is_old_or_new_also_without_exchange(tmp_path, monkeypatch):
    """``train.main.save_atomically`` (the draft LM's save), with RENAME_EXCHANGE and with the two-rename
    fallback of systems without it (there a kill between the renames is repaired by the next save)."""
    folder = tmp_path / "lm"

    def writer(text: str) -> Callable[[Path], None]:
        def save(tmp: Path) -> None:
            (tmp / "a.json").write_text(text)
            (tmp / "b.bin").write_bytes(text.encode() * 1000)
        return save

    def state() -> str | None:
        eagle.atomic.recover_directory(folder)
        if not folder.exists():
            return None
        a, b = (folder / "a.json").read_text(), (folder / "b.bin").read_bytes()
        assert b == a.encode() * 1000 and sorted(p.name for p in folder.iterdir()) == ["a.json", "b.bin"]
        return a

    def reset() -> None:
        for path in tmp_path.iterdir():
            shutil.rmtree(path)
        train.main.save_atomically(writer("old"), folder)

    for exchange in (True, False):
        seen = []
        with monkeypatch.context() as mp:
            if not exchange:
                mp.setattr(eagle.atomic, "_exchange", lambda a, b: False)
            kill_at_every_step(lambda: train.main.save_atomically(writer("new"), folder),
                               lambda: seen.append(state()), monkeypatch, reset)
        assert seen[0] == "old" and seen[-1] == "new" and set(seen) == {"old", "new"}, (exchange, seen)


def test_a_save_through_a_symbolic_link_or_into_the_current_folder_replaces_the_folder_it_names(tmp_path, monkeypatch):
    real = tmp_path / "store" / "v1"
    train.main.save_atomically(lambda tmp: (tmp / "a").write_text("old"), real)
    (tmp_path / "drafter").symlink_to(real, target_is_directory=True)
    train.main.save_atomically(lambda tmp: (tmp / "a").write_text("new"), tmp_path / "drafter")
    assert (tmp_path / "drafter").is_symlink() and (real / "a").read_text() == "new"
    assert sorted(p.name for p in real.parent.iterdir()) == ["v1"]
    monkeypatch.chdir(real)
    train.main.save_atomically(lambda tmp: (tmp / "a").write_text("newer"), ".")
    assert (real / "a").read_text() == "newer"


def fake_deepspeed_save(ckpt_dir: Path, step: int) -> None:
    """What ``engine.save_checkpoint`` leaves before publication: files under ``step<N>.partial``."""
    partial = ckpt_dir / checkpoint.partial_tag(f"step{step}")
    partial.mkdir(parents=True)
    torch.save({"step": step, "w": torch.full((64,), float(step))}, partial / "mp_rank_00_model_states.pt")
    (partial / "zero").mkdir()
    torch.save({"adam": step}, partial / "zero" / "optim_states.pt")


def test_checkpoint_publication_killed_at_any_step_keeps_latest_on_an_intact_checkpoint(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        fake_deepspeed_save(ckpt, step)
        checkpoint.publish(ckpt, f"step{step}", keep_last=2)
    assert checkpoint.checkpoints(ckpt) == ["step15", "step10"] and checkpoint.read_latest(ckpt) == "step15"
    fake_deepspeed_save(ckpt, 20)
    pristine = tmp_path / "pristine"
    shutil.copytree(ckpt, pristine)
    chosen = []

    def reset() -> None:
        shutil.rmtree(ckpt)
        shutil.copytree(pristine, ckpt)

    def check() -> None:
        for name in checkpoint.checkpoints(ckpt):  # every published folder is whole
            assert checkpoint.verify(ckpt / name) is None, name
        tag, verified, skipped = checkpoint.choose(ckpt)
        assert verified and tag in ("step15", "step20") and not skipped
        assert checkpoint.read_latest(ckpt) == tag
        chosen.append(tag)

    points = kill_at_every_step(lambda: checkpoint.publish(ckpt, "step20", keep_last=2), check, monkeypatch, reset)
    assert points >= 5 and chosen[0] == "step15" and chosen[-1] == "step20"
    checkpoint.clean(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step15", "step20"]


def published(tmp_path: Path, steps=(5, 10, 15), keep_last: int = 0) -> Path:
    ckpt = tmp_path / "checkpoints"
    for step in steps:
        fake_deepspeed_save(ckpt, step)
        checkpoint.publish(ckpt, f"step{step}", keep_last)
    return ckpt


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    (lambda d: flip_a_byte(d / "mp_rank_00_model_states.pt"), "mp_rank_00_model_states.pt does not match its sha256"),
    (lambda d: (d / "zero" / "optim_states.pt").write_bytes(b""), "zero/optim_states.pt has 0 bytes"),
    (lambda d: (d / "zero" / "optim_states.pt").unlink(), "zero/optim_states.pt missing"),
    (lambda d: (d / "manifest.json").write_text("{garbled"), "unreadable manifest.json"),
    (lambda d: (d / "extra.pt").write_bytes(b"x"), "extra.pt is not in the manifest"),
])
def test_a_corrupt_checkpoint_is_skipped_for_the_newest_intact_one(tmp_path, damage, reason):
    ckpt = published(tmp_path)
    damage(ckpt / "step15")
    tag, verified, skipped = checkpoint.choose(ckpt)
    assert (tag, verified) == ("step10", True) and len(skipped) == 1 and skipped[0].startswith(f"step15 ({reason}")
    message = checkpoint.resume_message(ckpt, tag, verified, skipped)
    assert message == f"eagle-train: resuming from {ckpt / 'step10'}; skipped: {skipped[0]}"
    assert "\n" not in message


@pytest.mark.parametrize("latest, said", [(b"", "latest is empty"), (b"\n  \n", "latest is empty"),
                                          (b"\xff\xfe\x00garbage", "latest is unreadable"),
                                          (b"step99", "latest names 'step99', which is no checkpoint folder"),
                                          (b"../../etc", "latest names '../../etc', which is no checkpoint folder")])
def test_an_empty_or_garbled_latest_file_falls_back_to_the_newest_intact_checkpoint(tmp_path, latest, said):
    ckpt = published(tmp_path)
    (ckpt / "latest").write_bytes(latest)
    tag, verified, skipped = checkpoint.choose(ckpt)
    assert (tag, verified, skipped) == ("step15", True, [said])
    assert checkpoint.resume_message(ckpt, tag, verified, skipped).startswith("eagle-train: resuming from")


def test_latest_is_preferred_and_checkpoints_without_a_manifest_are_a_last_resort(tmp_path):
    ckpt = published(tmp_path)
    (ckpt / "latest").write_text("step10")  # latest names an older intact checkpoint: it is the one used
    assert checkpoint.choose(ckpt) == ("step10", True, [])
    assert checkpoint.resume_message(ckpt, "step10", True, []) is None
    for name in ("step5", "step10", "step15"):  # checkpoints of a version without checksums
        (ckpt / name / "manifest.json").unlink()
    tag, verified, skipped = checkpoint.choose(ckpt)
    assert (tag, verified) == ("step10", False) and skipped == ["step15 (no manifest.json)", "step5 (no manifest.json)"]
    assert "unverified" in checkpoint.resume_message(ckpt, tag, verified, skipped)
    flip_a_byte(ckpt / "step5" / "mp_rank_00_model_states.pt")
    fake_deepspeed_save(ckpt, 20)
    checkpoint.publish(ckpt, "step20", 0)  # a verified checkpoint wins over unverified ones
    assert checkpoint.choose(ckpt)[:2] == ("step20", True)
    shutil.rmtree(tmp_path / "checkpoints")
    assert checkpoint.choose(ckpt) == (None, False, [])  # nothing there: a fresh start, nothing said
    ckpt.mkdir()
    (ckpt / "latest").write_text("")
    tag, verified, skipped = checkpoint.choose(ckpt)
    assert tag is None and "starting from step 0" in checkpoint.resume_message(ckpt, tag, verified, skipped)


def test_keep_last_deletes_older_checkpoints_but_never_the_latest(tmp_path):
    ckpt = published(tmp_path, steps=(5, 10, 15, 20, 25), keep_last=3)
    assert checkpoint.checkpoints(ckpt) == ["step25", "step20", "step15"]
    (ckpt / "latest").write_text("step15")
    assert checkpoint.prune(ckpt, 1) == ["step20"]  # step15 stays: latest names it
    assert checkpoint.checkpoints(ckpt) == ["step25", "step15"]
    assert checkpoint.prune(ckpt, 0) == []
    disk = published(tmp_path / "many", steps=range(1, 13), keep_last=3)
    assert len(list(disk.iterdir())) == 4  # three checkpoints and latest, however many were saved


def test_keep_last_is_a_typed_config_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("keep_last: 5\n")
    assert load_config_file(TrainConfig, str(path)).keep_last == 5
    path.write_text("keep_last: -1\n")
    with pytest.raises(EagleError, match="keep_last must be an integer >= 0"):
        load_config_file(TrainConfig, str(path))
    path.write_text("keep_last: many\n")
    with pytest.raises(EagleError, match="keep_last"):
        load_config_file(TrainConfig, str(path))


def identity(num_layers: int = 1, target_name: str = "t", weights: str = "w0", data: str = "d0",
             source: str = "f", examples: int = 10) -> dict:
    return checkpoint.run_identity("drafter", {"kind": "eagle", "num_layers": num_layers},
                                   {"name": target_name, "hidden_size": 32, "weights": weights},
                                   {"source": source, "examples": examples, "sha256": data})


def test_a_run_folder_refuses_a_run_of_another_architecture_target_or_data(tmp_path, capsys):
    out = tmp_path / "run"
    assert checkpoint.claim(out, identity()) is None  # a new folder: recorded
    ckpt = published(out, steps=(5, 10), keep_last=0)
    before = sorted(p.name for p in ckpt.iterdir())
    assert checkpoint.claim(out, identity(target_name="/elsewhere/t", source="g")) is None  # moved, not changed
    assert checkpoint.claim(out, identity()) is None
    for other, said in [(identity(num_layers=2), "architecture: num_layers 1 vs 2"),
                        (identity(weights="w1"), "target: 't' vs 't' (other weights or tokenizer)"),
                        (identity(data="d1", examples=12), "data: f (10 examples) vs f (12 examples)")]:
        refusal = checkpoint.claim(out, other)
        assert refusal == (f"{out} holds checkpoints of another run ({said}): choose another out_dir, or pass "
                           f"--start-over to delete them and start from step 0 there")
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing resumed, pruned or rewritten
    assert json.loads((out / checkpoint.RUN).read_text()) == identity()
    assert checkpoint.claim(out, identity(num_layers=2), start_over=True) is None
    assert not ckpt.exists() and json.loads((out / checkpoint.RUN).read_text()) == identity(num_layers=2)
    capsys.readouterr()
    legacy = published(tmp_path / "legacy", steps=(5,))  # checkpoints from before runs were recorded
    assert checkpoint.claim(tmp_path / "legacy", identity()) is None
    assert "its checkpoints are taken as this run's" in capsys.readouterr().err


def test_run_identity_digests_tell_targets_and_data_apart():
    a, b = tiny_target(seed=0, lean=False), tiny_target(seed=1, lean=False)
    assert checkpoint.weights_digest(a.model) == checkpoint.weights_digest(tiny_target(seed=0, lean=False).model)
    assert checkpoint.weights_digest(a.model) != checkpoint.weights_digest(b.model)
    assert checkpoint.weights_digest(a.model) == checkpoint.weights_digest(a.model.to(torch.bfloat16))
    embedding = torch.nn.Module()  # SmolLM2-135M's embedding: float positions would round past its end
    embedding.weight = torch.nn.Parameter(torch.zeros(49152 * 576))
    assert len(checkpoint.weights_digest(embedding)) == 16
    examples = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4], "loss_mask": [1]}]
    as_tensors = [{k: torch.tensor(v) for k, v in ex.items()} for ex in examples]
    assert checkpoint.examples_digest(examples) == checkpoint.examples_digest(as_tensors)
    for changed in ([{**examples[0], "loss_mask": [1, 1, 1]}, examples[1]], examples[:1],
                    [{"input_ids": [1, 2], "loss_mask": [0, 1]}, {"input_ids": [3, 4], "loss_mask": [1, 1]}]):
        assert checkpoint.examples_digest(changed) != checkpoint.examples_digest(examples)
