"""The tracked configs: every recipe step reads tracked files or an earlier step's output, never an ignored leftover."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
INPUT_KEYS = ("data", "features", "init_from", "drafter_config", "draft_lm_config", "deepspeed_config", "dev_data",
              "seeds_file", "draft_vocab_data", "replay")


def tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        pytest.skip("not a git checkout")
    return set(out.stdout.split())


def inputs(cfg: dict) -> list[str]:
    found = []
    for key in INPUT_KEYS:
        value = cfg.get(key)
        if isinstance(value, str) and value:
            found.append(value)
        elif isinstance(value, (list, tuple, dict)):
            found.extend(str(v) for v in value)
    return found


def test_recipes_read_only_tracked_files_or_earlier_steps():
    files = tracked()
    recipes = sorted({p.parent for p in (ROOT / "configs" / "recipes").rglob("*.yaml")})
    assert recipes, "no recipes"
    for recipe in recipes:
        outputs: set[str] = set()
        for step in ("selfdistill.yaml", "sharegpt.yaml", "sharegpt-answers.yaml", "features.yaml",
                     "features-answers.yaml", "train.yaml", "draft-lm.yaml"):
            path = recipe / step
            if not path.is_file():
                continue
            cfg = yaml.safe_load(path.read_text())
            for item in inputs(cfg):
                earlier = item in outputs or any(item.startswith(out.rstrip("/") + "/") for out in outputs)
                assert item in files or earlier or any(f.startswith(item.rstrip("/") + "/") for f in files), (
                    f"{path.relative_to(ROOT)} reads {item}: neither tracked nor an earlier step's output")
            if cfg.get("out_dir"):
                outputs.add(cfg["out_dir"])


def test_every_yaml_and_json_config_parses_and_names_tracked_inputs():
    files = tracked()
    for path in sorted((ROOT / "configs").rglob("*")):
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".yaml" and "recipes" not in path.parts:
            cfg = yaml.safe_load(path.read_text())
            assert isinstance(cfg, dict)
            for item in inputs(cfg):
                assert item in files, f"{path.relative_to(ROOT)} reads {item}, which is not tracked"
